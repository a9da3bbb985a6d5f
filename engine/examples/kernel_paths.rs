//! Prints the CPU kernels the engine runs (its weight products and dense attention), as the
//! workspace's one path detection chose them; `.ci/run` prints it in each forced pass.
fn main() {
    println!("{}", mosaickv_engine::kernel_paths());
}
