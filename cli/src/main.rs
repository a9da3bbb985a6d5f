fn main() { eprintln!("mosaickv: not built yet"); std::process::exit(2); }
