//! Progress of long steps on the terminal: an `indicatif` bar where stderr is a terminal,
//! one plain line per step where it is not (a log, CI), so a captured run still says how
//! far it got and how long each step took.

use std::io::IsTerminal as _;
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

/// A bar of `len` steps labelled `label`.
#[derive(Debug)]
pub struct Progress {
    bar: ProgressBar,
    label: String,
    plain: bool,
    step_started: Instant,
}

/// A progress bar of `len` steps: drawn on a terminal, plain lines elsewhere.
#[must_use]
pub fn bar(len: u64, label: &str) -> Progress {
    let plain = !std::io::stderr().is_terminal();
    let bar = if plain {
        ProgressBar::with_draw_target(Some(len), ProgressDrawTarget::hidden())
    } else {
        let bar = ProgressBar::new(len);
        let style = ProgressStyle::with_template(
            "{prefix} [{bar:30}] {pos}/{len} {elapsed_precise} (eta {eta}) {msg}",
        )
        .map_or_else(
            |_| ProgressStyle::default_bar(),
            |s| s.progress_chars("=> "),
        );
        bar.set_style(style);
        bar.enable_steady_tick(Duration::from_millis(250));
        bar
    };
    bar.set_prefix(label.to_owned());
    Progress {
        bar,
        label: label.to_owned(),
        plain,
        step_started: Instant::now(),
    }
}

impl Progress {
    /// What the current step does.
    pub fn set_message(&self, message: String) {
        self.bar.set_message(message);
    }

    /// One step done; where stderr is not a terminal, a line says which and how long it took.
    pub fn inc(&mut self, steps: u64) {
        self.bar.inc(steps);
        if self.plain {
            #[allow(clippy::print_stderr, reason = "progress is for the terminal's reader")]
            {
                eprintln!(
                    "  {} [{}/{}] {} {:.1} s",
                    self.label,
                    self.bar.position(),
                    self.bar.length().unwrap_or(0),
                    self.bar.message(),
                    self.step_started.elapsed().as_secs_f64()
                );
            }
        }
        self.step_started = Instant::now();
    }

    /// Removes the bar from the terminal.
    pub fn finish_and_clear(&self) {
        self.bar.finish_and_clear();
    }
}
