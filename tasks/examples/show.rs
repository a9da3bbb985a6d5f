//! Prints one generated sample: `cargo run -p mosaickv-tasks --example show -- TASK [TARGET] [SEED]`.
//! Tokens are counted as whitespace-separated words (a stand-in for a real tokenizer); the
//! answer budget is RULER's for RULER's tasks, 128 for the earlier variants.

use mosaickv_tasks::{generate, Task};

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let task = match args.first().map(|s| Task::from_name(s)) {
        Some(Ok(t)) => t,
        Some(Err(e)) => {
            eprintln!("{e}");
            std::process::exit(2);
        }
        None => Task::NiahSingle1,
    };
    let target: usize = args.get(1).and_then(|s| s.parse().ok()).unwrap_or(1024);
    let seed: u64 = args.get(2).and_then(|s| s.parse().ok()).unwrap_or(0);
    let count = |s: &str| s.split_whitespace().count();
    let budget = task.ruler_tokens_to_generate().unwrap_or(128);
    match generate(task, target, budget, seed, &count) {
        Ok(sample) => {
            println!("{}", sample.prompt());
            eprintln!("haystack: {}", sample.haystack);
            eprintln!("answers: {:?}", sample.answers);
        }
        Err(e) => {
            eprintln!("{e}");
            std::process::exit(1);
        }
    }
}
