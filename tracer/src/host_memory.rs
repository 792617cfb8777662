//! Host memory for CPU runs: freed blocks stay with the process for reuse.
//!
//! A traced pass at thousands of tokens allocates and frees `[S, S]` tensors (attention
//! and indexer scores, 150 MB at 6144 tokens) over and over. glibc serves each from a
//! fresh `mmap` and returns it on free, so every pass pays the kernel to fault in and zero
//! the same pages again. Measured on the 2-core machine, the trained GLM checkpoint traced
//! at 6144 tokens, three runs each: glibc's defaults 27.3 to 32.5 s wall (24.5 to 29.0 s
//! of it system time), 2.6 GB peak resident; with every block kept in the heap and the heap
//! never trimmed, 13.9 to 18.7 s wall (6.3 to 9.3 s system), 4.3 to 4.7 GB.
//!
//! glibc reads these settings once, when the process starts (`mallopt` from `main` is too
//! late for what libtorch allocated before, and caps the trim threshold at 2 GB: 19.8 s
//! in one run), so the binary runs itself again with them in its environment.

/// glibc's settings: no allocation served by `mmap`, the heap never trimmed (100 GB).
const SETTINGS: [(&str, &str); 2] = [
    ("MALLOC_MMAP_MAX_", "0"),
    ("MALLOC_TRIM_THRESHOLD_", "100000000000"),
];

/// Runs this binary again with [`SETTINGS`] in its environment, unless either is set
/// already (by that re-run, or by the user, whose choice stands). Call first thing in a
/// binary that runs the engine on the CPU. Where the re-run cannot start, it returns and
/// the process goes on as it is: slower, never different.
pub fn keep_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        use std::os::unix::process::CommandExt as _;
        if SETTINGS
            .iter()
            .any(|(name, _)| std::env::var_os(name).is_some())
        {
            return;
        }
        let Ok(exe) = std::env::current_exe() else {
            return;
        };
        // exec replaces this process (same pid) and returns only when it failed.
        let _failed = std::process::Command::new(exe)
            .args(std::env::args_os().skip(1))
            .envs(SETTINGS)
            .exec();
    }
}
