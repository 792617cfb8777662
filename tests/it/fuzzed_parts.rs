//! Fuzzed part files: a run's top-k part mutated at random (its counts, its
//! lists, its footer, bytes flipped, the file cut short) and its other parts
//! flipped or cut, then analysed. `analyze` never panics on any of them, and
//! never reports a corrupted top-k part clean: the run is skipped or refused
//! with the file named, or its top-k verdict is not judged, or what it reads
//! is what the unmutated part gives (a mutation that changed nothing the
//! metric reads, such as a footer byte of a statistic no reader uses).
//!
//! Bytes flipped inside a compressed data page can decompress to other
//! valid values: the writers store no page checksums, so no reader can tell
//! those from the values written. For them the test asserts no panic only;
//! every mutation of counts and lists (the summary carries each twice: the
//! counts and the lists they come from), of the footer, and every
//! truncation must be found.
//!
//! The seed is printed (`cargo test fuzzed_parts -- --nocapture`) and read
//! from `SHADOWTRACE_FUZZ_SEED` to rerun a failing case; a new one is drawn
//! on every run, so each `cargo test` tries new cases.

use std::fs::File;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use arrow_array::types::Int32Type;
use arrow_array::{Array, ArrayRef, Float32Array, Int32Array, ListArray, RecordBatch};
use parquet::arrow::ArrowWriter;
use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;
use parquet::file::properties::WriterProperties;
use shadowtrace_analyzer::judged::Question;
use shadowtrace_analyzer::metrics::topk_overlap::LayerOverlap;
use shadowtrace_analyzer::{Options, analyze};
use shadowtrace_tracer::WriterOptions;

use crate::analyze_verdicts::clean;

/// Cases per `cargo test`: each writes and analyses a small run twice over.
const CASES: u64 = 160;

/// splitmix64: a generator the seed fully decides, with no crate behind it.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

fn seed() -> u64 {
    std::env::var("SHADOWTRACE_FUZZ_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(1, |d| d.as_nanos() as u64)
        })
}

/// The count columns of a v2 top-k row: each also follows from the row's lists.
const COUNTS: [&str; 9] = [
    "prod_selected",
    "shadow_selected",
    "shared",
    "churn_shared",
    "churn_prod_only",
    "churn_shadow_only",
    "churn_unselected",
    "jaccard",
    "jaccard_no_churn",
];

/// The gap-coded key lists of a v2 top-k row.
const LISTS: [&str; 4] = [
    "prod_only_gaps",
    "shadow_only_gaps",
    "prod_boundary_gaps",
    "shadow_boundary_gaps",
];

/// What a case did to the run, for the failure message.
enum Mutation {
    /// A count of one sparse row with a shadow set to another value.
    Count {
        column: &'static str,
        row: usize,
        from: String,
        to: String,
    },
    /// One row's key list edited.
    List {
        column: &'static str,
        row: usize,
        edit: &'static str,
    },
    /// A byte of the top-k part's footer (its Thrift metadata) flipped.
    Footer { at: usize, mask: u8 },
    /// A byte of a part's data flipped (no page checksum can catch it).
    Flip { part: String, at: usize, mask: u8 },
    /// A part cut short.
    Truncate { part: String, at: usize },
}

impl std::fmt::Display for Mutation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Mutation::Count {
                column,
                row,
                from,
                to,
            } => {
                write!(f, "topk row {row}: {column} {from} -> {to}")
            }
            Mutation::List { column, row, edit } => write!(f, "topk row {row}: {column} {edit}"),
            Mutation::Footer { at, mask } => write!(f, "topk footer byte {at} ^= {mask:#04x}"),
            Mutation::Flip { part, at, mask } => write!(f, "{part} byte {at} ^= {mask:#04x}"),
            Mutation::Truncate { part, at } => write!(f, "{part} cut to {at} bytes"),
        }
    }
}

impl Mutation {
    /// Whether the format holds what it changed twice, so that a reader can
    /// find it.
    fn detectable(&self) -> bool {
        matches!(
            self,
            Mutation::Count { .. }
                | Mutation::List { .. }
                | Mutation::Footer { .. }
                | Mutation::Truncate { .. }
        )
    }
}

fn topk_part(run: &Path) -> PathBuf {
    run.join("topk/part-00000.parquet")
}

/// The top-k part as one batch, with its footer's key-value metadata.
fn read_part(path: &Path) -> (RecordBatch, Option<Vec<parquet::file::metadata::KeyValue>>) {
    let builder = ParquetRecordBatchReaderBuilder::try_new(File::open(path).unwrap()).unwrap();
    let kv = builder
        .metadata()
        .file_metadata()
        .key_value_metadata()
        .cloned();
    let mut batches: Vec<RecordBatch> = builder
        .with_batch_size(1 << 20)
        .build()
        .unwrap()
        .map(Result::unwrap)
        .collect();
    assert_eq!(batches.len(), 1, "the run fits one batch");
    (batches.remove(0), kv)
}

fn write_part(
    path: &Path,
    batch: &RecordBatch,
    kv: Option<Vec<parquet::file::metadata::KeyValue>>,
) {
    let props = WriterProperties::builder()
        .set_key_value_metadata(kv)
        .build();
    let mut writer =
        ArrowWriter::try_new(File::create(path).unwrap(), batch.schema(), Some(props)).unwrap();
    writer.write(batch).unwrap();
    writer.close().unwrap();
}

fn column<'a>(batch: &'a RecordBatch, name: &str) -> &'a ArrayRef {
    batch.column(batch.schema().index_of(name).unwrap())
}

fn replace(batch: &RecordBatch, name: &str, new: ArrayRef) -> RecordBatch {
    let i = batch.schema().index_of(name).unwrap();
    let mut columns = batch.columns().to_vec();
    columns[i] = new;
    RecordBatch::try_new(batch.schema(), columns).unwrap()
}

/// Rows a summary describes: more visible keys than k, and a shadow.
fn sparse_rows(batch: &RecordBatch) -> Vec<usize> {
    let ints = |name| {
        column(batch, name)
            .as_any()
            .downcast_ref::<Int32Array>()
            .unwrap()
            .clone()
    };
    let (k, visible) = (ints("k"), ints("visible"));
    let shadow = column(batch, "shadow_selected");
    (0..batch.num_rows())
        .filter(|&i| visible.value(i) > k.value(i) && shadow.is_valid(i))
        .collect()
}

/// A value other than `v` that a damaged file or a defective producer may hold.
fn other_i32(rng: &mut Rng, v: i32) -> i32 {
    let candidates = [
        v.wrapping_add(1),
        v.wrapping_sub(1),
        v.wrapping_add(5000),
        -1,
        0,
        i32::MAX,
        i32::MIN,
        v.wrapping_mul(2),
    ];
    let picked = candidates[rng.below(candidates.len())];
    if picked == v {
        v.wrapping_add(3)
    } else {
        picked
    }
}

fn mutate_count(rng: &mut Rng, path: &Path) -> Option<Mutation> {
    let (batch, kv) = read_part(path);
    let sparse = sparse_rows(&batch);
    let row = sparse[rng.below(sparse.len())];
    let name = COUNTS[rng.below(COUNTS.len())];
    let c = column(&batch, name);
    if !c.is_valid(row) {
        return None;
    }
    let (new, from, to): (ArrayRef, String, String) =
        if let Some(a) = c.as_any().downcast_ref::<Int32Array>() {
            let (from, to) = (a.value(row), other_i32(rng, a.value(row)));
            let values = (0..a.len()).map(|i| {
                a.is_valid(i)
                    .then(|| if i == row { to } else { a.value(i) })
            });
            (
                Arc::new(values.collect::<Int32Array>()),
                from.to_string(),
                to.to_string(),
            )
        } else {
            let a = c.as_any().downcast_ref::<Float32Array>().unwrap();
            let from = a.value(row);
            let to = [from - 0.25, from + 0.5, f32::NAN, -1.0][rng.below(4)];
            let values = (0..a.len()).map(|i| {
                a.is_valid(i)
                    .then(|| if i == row { to } else { a.value(i) })
            });
            (
                Arc::new(values.collect::<Float32Array>()),
                from.to_string(),
                to.to_string(),
            )
        };
    write_part(path, &replace(&batch, name, new), kv);
    Some(Mutation::Count {
        column: name,
        row,
        from,
        to,
    })
}

fn mutate_list(rng: &mut Rng, path: &Path) -> Option<Mutation> {
    let (batch, kv) = read_part(path);
    let sparse = sparse_rows(&batch);
    let row = sparse[rng.below(sparse.len())];
    let name = LISTS[rng.below(LISTS.len())];
    let a = column(&batch, name)
        .as_any()
        .downcast_ref::<ListArray>()
        .unwrap();
    let lists: Vec<Option<Vec<i32>>> = (0..a.len())
        .map(|i| {
            a.is_valid(i).then(|| {
                a.value(i)
                    .as_any()
                    .downcast_ref::<Int32Array>()
                    .unwrap()
                    .values()
                    .to_vec()
            })
        })
        .collect();
    let mut edited = lists.clone();
    let edit = match (rng.below(4), &mut edited[row]) {
        (0, Some(list)) => {
            list.push(1 + rng.below(7) as i32);
            "a key appended"
        }
        (1, Some(list)) if !list.is_empty() => {
            list.remove(0);
            "its first key removed"
        }
        (2, Some(list)) if !list.is_empty() => {
            list[0] = list[0].wrapping_add(1 + rng.below(3) as i32);
            "its first key moved"
        }
        (_, slot) => {
            *slot = None;
            "made null"
        }
    };
    if edited[row] == lists[row] {
        return None;
    }
    let rows = edited
        .into_iter()
        .map(|l| l.map(|v| v.into_iter().map(Some).collect::<Vec<_>>()));
    let new: ArrayRef = Arc::new(ListArray::from_iter_primitive::<Int32Type, _, _>(rows));
    write_part(path, &replace(&batch, name, new), kv);
    Some(Mutation::List {
        column: name,
        row,
        edit,
    })
}

/// Every part file of the run, sorted.
fn parts(run: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for table in std::fs::read_dir(run).unwrap() {
        let table = table.unwrap().path();
        if table.is_dir() {
            for part in std::fs::read_dir(&table).unwrap() {
                out.push(part.unwrap().path());
            }
        }
    }
    out.sort();
    out
}

fn relative(run: &Path, part: &Path) -> String {
    part.strip_prefix(run).unwrap().display().to_string()
}

fn mutate(rng: &mut Rng, run: &Path) -> Option<Mutation> {
    let path = topk_part(run);
    Some(match rng.below(10) {
        0..=2 => mutate_count(rng, &path)?,
        3..=4 => mutate_list(rng, &path)?,
        5..=6 => {
            let mut bytes = std::fs::read(&path).unwrap();
            let len = bytes.len();
            let footer = u32::from_le_bytes(bytes[len - 8..len - 4].try_into().unwrap()) as usize;
            let at = len - 8 - footer + rng.below(footer + 8);
            let mask = 1u8 << rng.below(8);
            bytes[at] ^= mask;
            std::fs::write(&path, bytes).unwrap();
            Mutation::Footer { at, mask }
        }
        7..=8 => {
            let all = parts(run);
            let part = &all[rng.below(all.len())];
            let mut bytes = std::fs::read(part).unwrap();
            let at = 4 + rng.below(bytes.len() - 12);
            let mask = 1u8 << rng.below(8);
            bytes[at] ^= mask;
            std::fs::write(part, bytes).unwrap();
            Mutation::Flip {
                part: relative(run, part),
                at,
                mask,
            }
        }
        _ => {
            let all = parts(run);
            let part = &all[rng.below(all.len())];
            let bytes = std::fs::read(part).unwrap();
            let at = rng.below(bytes.len());
            std::fs::write(part, &bytes[..at]).unwrap();
            Mutation::Truncate {
                part: relative(run, part),
                at,
            }
        }
    })
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap().path();
        let target = to.join(entry.file_name().unwrap());
        if entry.is_dir() {
            copy_dir(&entry, &target);
        } else {
            std::fs::copy(&entry, &target).unwrap();
        }
    }
}

/// What the top-k verdict reads of a run: its layers, or `None` where the run
/// was skipped or its top-k verdict is not judged.
fn judged_topk(run: &Path) -> Result<Option<Vec<LayerOverlap>>, String> {
    let analysed = catch_unwind(AssertUnwindSafe(|| {
        analyze(&[run.to_owned()], &[], &Options::default(), |_, _, _| {})
    }))
    .map_err(|panic| {
        panic
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| panic.downcast_ref::<&str>().map(|s| (*s).to_owned()))
            .unwrap_or_default()
    })?;
    Ok(match analysed {
        Err(_) => None,
        Ok(a) if a.runs.is_empty() => {
            assert!(!a.skipped.is_empty(), "a run neither analysed nor skipped");
            None
        }
        Ok(a) => {
            let run = &a.runs[0];
            run.judged(Question::Topk).then(|| run.topk.clone())
        }
    })
}

#[test]
fn mutated_parts_are_skipped_refused_or_not_judged_never_a_panic_or_a_clean_verdict() {
    let seed = seed();
    println!("fuzzed_parts: seed {seed} (rerun with SHADOWTRACE_FUZZ_SEED={seed})");
    let tmp = tempfile::tempdir().unwrap();
    let template = tmp.path().join("template");
    clean("fuzzed")
        .write(&template, WriterOptions::default())
        .unwrap();
    let unmutated = judged_topk(&template)
        .unwrap()
        .expect("the unmutated run is judged");
    let mut rng = Rng(seed);
    let mut tried = 0;
    for case in 0..CASES {
        let dir = tmp.path().join(format!("case-{case}"));
        copy_dir(&template, &dir);
        let Some(mutation) = mutate(&mut rng, &dir) else {
            std::fs::remove_dir_all(&dir).unwrap();
            continue;
        };
        tried += 1;
        let context = format!("seed {seed}, case {case}: {mutation}");
        match judged_topk(&dir) {
            Err(panic) => panic!("{context}: analyze panicked: {panic}"),
            Ok(Some(layers)) if mutation.detectable() => assert_eq!(
                layers, unmutated,
                "{context}: judged whole, yet what it read differs from the unmutated part"
            ),
            Ok(_) => {}
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }
    assert!(
        tried > CASES / 2,
        "seed {seed}: only {tried} of {CASES} cases mutated anything"
    );
}

/// The footer of `part` rewritten with its first column chunk moved by `claim`
/// (its offset and compressed size), the data pages left as they were.
fn claim_first_chunk(part: &Path, claim: impl Fn(i64, i64) -> (i64, i64)) {
    use parquet::file::metadata::{ParquetMetaDataReader, ParquetMetaDataWriter};

    let bytes = std::fs::read(part).unwrap();
    let footer = u32::from_le_bytes(bytes[bytes.len() - 8..bytes.len() - 4].try_into().unwrap());
    let data_end = bytes.len() - 8 - footer as usize;
    let metadata =
        ParquetMetaDataReader::decode_metadata(&bytes[data_end..bytes.len() - 8]).unwrap();
    let mut builder = metadata.into_builder();
    let mut groups = builder.take_row_groups();
    let mut columns = groups[0].columns().to_vec();
    let first = columns[0].clone();
    let (offset, size) = claim(first.data_page_offset(), first.compressed_size());
    columns[0] = first
        .into_builder()
        .set_dictionary_page_offset(None)
        .set_data_page_offset(offset)
        .set_total_compressed_size(size)
        .build()
        .unwrap();
    groups[0] = groups[0]
        .clone()
        .into_builder()
        .set_column_metadata(columns)
        .build()
        .unwrap();
    let metadata = builder.set_row_groups(groups).build();
    let mut out = bytes[..data_end].to_vec();
    ParquetMetaDataWriter::new(&mut out, &metadata)
        .finish()
        .unwrap();
    std::fs::write(part, out).unwrap();
}

/// The case the random draw once found (seed 1796602574452636641, case 88: a
/// flipped footer byte of a logits part made polars add a chunk's offset and
/// size past i64 and panic), made by hand so that every run tries it: a chunk
/// whose end overflows, and one that ends past the file.
#[test]
fn a_part_whose_column_chunk_lies_outside_the_file_is_refused_naming_it_not_a_panic() {
    let tmp = tempfile::tempdir().unwrap();
    type Claim = fn(i64, i64) -> (i64, i64);
    let claims: [(&str, Claim); 2] = [
        ("overflowing", |_, size| (-1, size)),
        ("past the end", |offset, size| (offset, size + (1 << 20))),
    ];
    for (what, claim) in claims {
        let run = tmp.path().join(what.replace(' ', "-"));
        clean("outside")
            .write(&run, WriterOptions::default())
            .unwrap();
        let part = run.join("logits/part-00000.parquet");
        claim_first_chunk(&part, claim);
        let analysed = catch_unwind(AssertUnwindSafe(|| {
            analyze(
                std::slice::from_ref(&run),
                &[],
                &Options::default(),
                |_, _, _| {},
            )
        }));
        let Ok(analysed) = analysed else {
            panic!("{what}: analyze panicked")
        };
        let refused = match analysed {
            Err(e) => e.to_string(),
            Ok(a) => {
                assert!(a.runs.is_empty(), "{what}: the run was read as whole");
                a.skipped.join("\n")
            }
        };
        assert!(
            refused.contains("logits/part-00000.parquet")
                && refused.contains("expected inside the file's"),
            "{what}: {refused}"
        );
    }
}
