//! Test helper for `killed_writer`: opens a run, completes the `hidden`
//! table, leaves a `topk` part half-written, prints `ready` and waits to be
//! killed. Not for users.

use std::io::Write;
use std::path::PathBuf;
use std::time::Duration;

use shadowtrace_schemas::{TMP_SUFFIX, Table};
use shadowtrace_tracer::record::{HiddenRow, Selection, SelectionUnit, TopkRow, VectorStats};
use shadowtrace_tracer::synth::{SplitMix64, SynthSpec, realistic_selection_pair};
use shadowtrace_tracer::{RunWriter, WriterOptions};

/// Rows of `hidden` the helper completes before it hangs.
const HIDDEN_ROWS: i32 = 20_000;
/// Rows of `topk` it sends afterwards: one 256-row batch reaches the open
/// part file, the rest stay in memory.
const TOPK_ROWS: i32 = 300;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dir = PathBuf::from(
        std::env::args()
            .nth(1)
            .ok_or("usage: write-then-hang RUN_DIR")?,
    );
    let spec = SynthSpec {
        run_id: "killed".to_owned(),
        ..SynthSpec::demo("killed")
    };
    let writer = RunWriter::create(&dir, spec.identity(), WriterOptions::default())?;
    for token in 0..HIDDEN_ROWS {
        let _ = writer.send(HiddenRow {
            seq: i64::from(token),
            step: 0,
            layer: 0,
            site: "layer_in".to_owned(),
            token,
            numel: 6144,
            prod: VectorStats {
                max_abs: 1.0,
                l2: 1.0,
                ..VectorStats::default()
            },
            shadow: None,
        });
    }
    writer.close_table(Table::Hidden);
    let mut rng = SplitMix64(3);
    for token in 0..TOPK_ROWS {
        let (indices, _) = realistic_selection_pair(4096, 2048, 1.0, &mut rng);
        let _ = writer.send(TopkRow {
            step: 0,
            layer: 0,
            token,
            indexer_layer: 0,
            unit: SelectionUnit::TOKEN,
            k: 2048,
            visible: 4096,
            prod: Selection {
                indices,
                ..Selection::default()
            },
            shadow: None,
            boundary_band: None,
        });
    }
    let manifest = dir.join("manifest.json");
    let open_part = dir.join(format!("topk/part-00000.parquet{TMP_SUFFIX}"));
    loop {
        let listed = std::fs::read_to_string(&manifest)
            .is_ok_and(|m| m.contains("hidden/part-00000.parquet"));
        if listed && open_part.exists() {
            break;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    writeln!(std::io::stdout(), "ready")?;
    std::io::stdout().flush()?;
    std::thread::sleep(Duration::from_secs(600));
    drop(writer);
    Ok(())
}
