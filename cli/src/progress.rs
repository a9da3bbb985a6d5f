//! Progress of a suite (`eval`, `frontier`) on stderr. On a terminal, indicatif's bar; anywhere
//! else (a log file, CI) indicatif hides the bar, so one plain line per finished prompt
//! instead, e.g. `eval: prompt 3/24 done (vt 1024 #0), 2 min 5 s elapsed`.

use indicatif::{ProgressBar, ProgressStyle};
use mosaickv_eval::Observer;
use std::io::Write;
use std::time::Instant;

/// The bar or the plain lines; what `mosaickv_eval::run_suite` reports to.
pub struct Progress {
    bar: ProgressBar,
    /// Where the plain lines go when the bar is hidden.
    plain: Option<Box<dyn Write>>,
    /// The command's name, first word of each plain line.
    label: &'static str,
    prompts: usize,
    done: usize,
    /// Prompts run in this process (not read back from a run log) and their time.
    ran: usize,
    ran_s: f64,
    start: Instant,
    last: Instant,
}

impl Progress {
    /// A bar over `prompts x methods` runs on stderr, or plain lines there when stderr is not
    /// a terminal.
    pub fn stderr(label: &'static str, prompts: usize, methods: usize) -> Self {
        let bar = ProgressBar::new((prompts * methods) as u64);
        bar.set_style(
            ProgressStyle::with_template(
                "{elapsed_precise} [{bar:30}] {pos}/{len} (eta {eta}) {msg}",
            )
            .expect("valid template")
            .progress_chars("=> "),
        );
        if bar.is_hidden() {
            Self::plain(label, prompts, Box::new(std::io::stderr()))
        } else {
            Self::with(bar, None, label, prompts)
        }
    }

    /// Plain lines into `out` (no bar).
    pub fn plain(label: &'static str, prompts: usize, out: Box<dyn Write>) -> Self {
        Self::with(ProgressBar::hidden(), Some(out), label, prompts)
    }

    fn with(
        bar: ProgressBar,
        plain: Option<Box<dyn Write>>,
        label: &'static str,
        prompts: usize,
    ) -> Self {
        Self {
            bar,
            plain,
            label,
            prompts,
            done: 0,
            ran: 0,
            ran_s: 0.0,
            start: Instant::now(),
            last: Instant::now(),
        }
    }

    pub fn finish(&self) {
        self.bar.finish_and_clear();
    }
}

impl Observer for Progress {
    /// What runs now (shown beside the bar).
    fn set_message(&mut self, msg: String) {
        self.bar.set_message(msg);
    }

    /// One method finished on the current prompt.
    fn inc(&mut self) {
        self.bar.inc(1);
    }

    /// Every method finished on prompt `what` (`ran`: run now, not read back from a run
    /// log): the plain line, when there is no bar, with the time elapsed and an estimate of
    /// the time left (the mean time of the prompts run now, times the prompts left).
    fn prompt_done(&mut self, what: &str, ran: bool) {
        self.done += 1;
        let now = Instant::now();
        if ran {
            self.ran += 1;
            self.ran_s += (now - self.last).as_secs_f64();
        }
        self.last = now;
        let left = self.prompts.saturating_sub(self.done);
        let eta = if self.ran > 0 && left > 0 {
            format!(
                ", about {} left",
                secs(self.ran_s / self.ran as f64 * left as f64)
            )
        } else {
            String::new()
        };
        let line = format!(
            "{}: prompt {}/{} {} ({what}), {} elapsed{eta}",
            self.label,
            self.done,
            self.prompts,
            if ran {
                "done"
            } else {
                "resumed from the run log"
            },
            secs(self.start.elapsed().as_secs_f64())
        );
        if let Some(w) = &mut self.plain {
            // Progress is best effort: a closed stderr does not stop the suite.
            let _ = writeln!(w, "{line}");
        }
    }

    /// A line above the bar, or a plain line.
    fn say(&mut self, msg: String) {
        match &mut self.plain {
            Some(w) => {
                let _ = writeln!(w, "{msg}");
            }
            None => self.bar.println(msg),
        }
    }
}

/// Seconds as a short string.
pub fn secs(s: f64) -> String {
    if s >= 60.0 {
        format!("{:.0} min {:.0} s", (s / 60.0).floor(), s % 60.0)
    } else {
        format!("{s:.1} s")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::{Arc, Mutex};

    /// A `Write` whose bytes the test reads back.
    #[derive(Clone, Default)]
    struct Shared(Arc<Mutex<Vec<u8>>>);
    impl Write for Shared {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(b);
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn plain_progress_prints_one_line_per_finished_prompt() {
        let buf = Shared::default();
        let mut p = Progress::plain("eval", 2, Box::new(buf.clone()));
        let text = |b: &Shared| String::from_utf8(b.0.lock().unwrap().clone()).unwrap();
        for (i, what) in ["vt 1024 #0", "vt 1024 #1"].iter().enumerate() {
            p.set_message(format!("{what}: prefill"));
            for _ in 0..3 {
                p.inc();
            }
            assert_eq!(
                text(&buf).lines().count(),
                i,
                "a line before the prompt finished"
            );
            p.prompt_done(what, true);
        }
        p.say("a verbose prediction".into());
        p.finish();
        let out = text(&buf);
        let lines: Vec<&str> = out.lines().collect();
        assert_eq!(lines.len(), 3, "{out}");
        assert!(
            lines[0].starts_with("eval: prompt 1/2 done (vt 1024 #0), "),
            "{out}"
        );
        assert!(
            lines[1].starts_with("eval: prompt 2/2 done (vt 1024 #1), "),
            "{out}"
        );
        assert!(
            lines[0].contains(" s elapsed, about ") && lines[0].ends_with(" s left"),
            "{out}"
        );
        assert!(
            lines[1].ends_with(" s elapsed"),
            "the last prompt has nothing left: {out}"
        );
        assert_eq!(lines[2], "a verbose prediction");
    }
}
