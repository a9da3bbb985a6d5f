//! `mosaickv inspect --cache DIR`: memory breakdown and per-segment strategies.

use crate::cachedir;
use crate::error::CliError;
use mosaickv_spec::persist::load_cache;
use std::path::PathBuf;

#[derive(clap::Args)]
pub struct Args {
    /// Cache directory written by `compress`.
    #[arg(long)]
    pub cache: PathBuf,
}

pub fn run(a: Args) -> Result<(), CliError> {
    let (cache, hk, hv) = load_cache(&cachedir::cache_path(&a.cache))?;
    let m = cachedir::memory(&cache, &hk, &hv);
    print!("{}", cachedir::report_text(&cache, &m));
    Ok(())
}
