//! `mosaickv inspect --cache DIR`: memory breakdown and per-segment strategies.

use crate::cachedir;
use crate::error::CliError;
use mosaickv_optimized::{LiveCache, Mode};
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
    // The same structural checks `attend` makes (host rows finite and within range, equal to
    // the buffer's f16 rows, the open segment a whole number of flushes): a file `attend`
    // refuses is not reported as a healthy cache.
    LiveCache::from_parts(cache.clone(), hk.clone(), hv.clone(), Mode::Sync)?;
    let m = cachedir::memory(&cache, &hk, &hv);
    print!("{}", cachedir::report_text(&cache, &m));
    Ok(())
}
