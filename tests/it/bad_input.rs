//! Bad input is rejected with an error that names the file and the problem.

use std::fs::{self, File};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use arrow_array::{Array, ArrayRef, Int32Array, Int64Array, RecordBatch};
use arrow_schema::{DataType, Field, Schema};
use parquet::arrow::ArrowWriter;
use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;
use parquet::file::metadata::KeyValue;
use parquet::file::properties::WriterProperties;
use shadowtrace_analyzer::{Dataset, LoadError, Run};
use shadowtrace_schemas::{MANIFEST_FILE, META_RUN_ID, META_SCHEMA_VERSION, META_TABLE};
use shadowtrace_tracer::WriterOptions;

use crate::support::small_spec;

/// A complete run at `<tmp>/run`; returns its directory.
fn good_run(tmp: &Path) -> PathBuf {
    let dir = tmp.join("run");
    small_spec("bad-input")
        .write(&dir, WriterOptions::default())
        .unwrap();
    dir
}

fn hidden_part(dir: &Path) -> PathBuf {
    dir.join("hidden/part-00000.parquet")
}

fn open_err(dir: &Path) -> LoadError {
    Run::open(dir).expect_err("the run must be rejected")
}

fn edit_manifest(dir: &Path, edit: impl FnOnce(&mut serde_json::Value)) {
    let path = dir.join(MANIFEST_FILE);
    let mut value: serde_json::Value =
        serde_json::from_str(&fs::read_to_string(&path).unwrap()).unwrap();
    edit(&mut value);
    fs::write(path, value.to_string()).unwrap();
}

/// Rewrites a part file through `edit`, keeping or replacing its metadata.
fn rewrite_part(
    path: &Path,
    metadata: Vec<KeyValue>,
    edit: impl FnOnce(RecordBatch) -> RecordBatch,
) {
    let reader = ParquetRecordBatchReaderBuilder::try_new(File::open(path).unwrap())
        .unwrap()
        .build()
        .unwrap();
    let batches: Vec<RecordBatch> = reader.map(Result::unwrap).collect();
    let schema = batches[0].schema();
    let batch = edit(arrow_select_concat(&schema, &batches));
    let props = WriterProperties::builder()
        .set_key_value_metadata(Some(metadata))
        .build();
    let mut writer =
        ArrowWriter::try_new(File::create(path).unwrap(), batch.schema(), Some(props)).unwrap();
    writer.write(&batch).unwrap();
    writer.close().unwrap();
}

fn arrow_select_concat(schema: &Arc<Schema>, batches: &[RecordBatch]) -> RecordBatch {
    assert_eq!(batches.len(), 1, "the small run fits one batch");
    RecordBatch::try_new(schema.clone(), batches[0].columns().to_vec()).unwrap()
}

fn metadata(version: &str) -> Vec<KeyValue> {
    vec![
        KeyValue::new(META_SCHEMA_VERSION.to_owned(), version.to_owned()),
        KeyValue::new(META_TABLE.to_owned(), "hidden".to_owned()),
        KeyValue::new(META_RUN_ID.to_owned(), "bad-input".to_owned()),
    ]
}

fn replace_column(
    batch: &RecordBatch,
    name: &str,
    field: Option<Field>,
    array: Option<ArrayRef>,
) -> RecordBatch {
    let schema = batch.schema();
    let mut fields = Vec::new();
    let mut columns = Vec::new();
    for (f, c) in schema.fields().iter().zip(batch.columns()) {
        if f.name() == name {
            if let (Some(field), Some(array)) = (&field, &array) {
                fields.push(field.clone());
                columns.push(array.clone());
            }
        } else {
            fields.push(f.as_ref().clone());
            columns.push(c.clone());
        }
    }
    RecordBatch::try_new(Arc::new(Schema::new(fields)), columns).unwrap()
}

#[test]
fn a_run_without_its_manifest_is_named_as_such() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = good_run(tmp.path());
    fs::remove_file(dir.join(MANIFEST_FILE)).unwrap();
    match open_err(&dir) {
        LoadError::MissingManifest { run } => assert_eq!(run, dir),
        other => panic!("expected MissingManifest, got {other}"),
    }
}

#[test]
fn a_manifest_that_is_not_json_is_corrupt_with_its_position() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = good_run(tmp.path());
    fs::write(dir.join(MANIFEST_FILE), "{\"schema_version\": 1,\n  oops").unwrap();
    let err = open_err(&dir);
    assert!(
        matches!(&err, LoadError::CorruptManifest { path, .. } if *path == dir.join(MANIFEST_FILE)),
        "{err}"
    );
    assert!(err.to_string().contains("line 2"), "{err}");
}

#[test]
fn a_manifest_missing_a_field_is_corrupt_and_names_the_field() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = good_run(tmp.path());
    edit_manifest(&dir, |m| {
        m.as_object_mut().unwrap().remove("model");
    });
    let err = open_err(&dir);
    assert!(matches!(err, LoadError::CorruptManifest { .. }), "{err}");
    assert!(err.to_string().contains("missing field `model`"), "{err}");
}

#[test]
fn a_manifest_of_another_format_version_is_unknown_not_corrupt() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = good_run(tmp.path());
    edit_manifest(&dir, |m| {
        m["schema_version"] = 3.into();
        m["model"] = "a field whose shape changed in v3".into();
    });
    match open_err(&dir) {
        LoadError::UnknownSchemaVersion {
            path,
            expected,
            got,
        } => {
            assert_eq!(
                (path, expected.as_str(), got.as_str()),
                (dir.join(MANIFEST_FILE), "1 or 2", "3")
            );
        }
        other => panic!("expected UnknownSchemaVersion, got {other}"),
    }
}

#[test]
fn a_part_file_of_another_format_version_is_unknown() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = good_run(tmp.path());
    rewrite_part(&hidden_part(&dir), metadata("3"), |b| b);
    match open_err(&dir) {
        LoadError::UnknownSchemaVersion {
            path,
            expected,
            got,
        } => assert_eq!(
            (path, expected.as_str(), got.as_str()),
            (hidden_part(&dir), "1 or 2", "3")
        ),
        other => panic!("expected UnknownSchemaVersion, got {other}"),
    }
}

#[test]
fn a_part_file_missing_a_footer_key_is_refused_naming_the_key() {
    for key in [META_SCHEMA_VERSION, META_TABLE, META_RUN_ID] {
        let tmp = tempfile::tempdir().unwrap();
        let dir = good_run(tmp.path());
        let mut kv = metadata("2");
        kv.retain(|e| e.key != key);
        rewrite_part(&hidden_part(&dir), kv, |b| b);
        let err = open_err(&dir);
        match &err {
            LoadError::MissingMetadata { path, key: missing } => {
                assert_eq!((path, *missing), (&hidden_part(&dir), key));
            }
            other => panic!("expected MissingMetadata, got {other}"),
        }
        assert!(
            err.to_string()
                .contains(&format!("metadata {key} is missing")),
            "{err}"
        );
    }
}

#[test]
fn a_truncated_part_file_is_named_truncated() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = good_run(tmp.path());
    let path = hidden_part(&dir);
    let bytes = fs::read(&path).unwrap();
    fs::write(&path, &bytes[..bytes.len() / 2]).unwrap();
    let err = open_err(&dir);
    assert!(
        matches!(&err, LoadError::TruncatedParquet { path: p, .. } if *p == path),
        "{err}"
    );
    assert!(err.to_string().contains("footer is missing"), "{err}");
}

#[test]
fn a_missing_column_is_named_with_its_table_and_file() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = good_run(tmp.path());
    rewrite_part(&hidden_part(&dir), metadata("2"), |b| {
        replace_column(&b, "cosine", None, None)
    });
    let err = open_err(&dir);
    match &err {
        LoadError::MissingColumn {
            path,
            table,
            column,
        } => {
            assert_eq!(
                (path, *table, column.as_str()),
                (&hidden_part(&dir), "hidden", "cosine")
            );
        }
        other => panic!("expected MissingColumn, got {other}"),
    }
    assert_eq!(
        err.to_string(),
        format!(
            "parquet file {}: table hidden is missing column cosine",
            hidden_part(&dir).display()
        )
    );
}

#[test]
fn a_column_of_the_wrong_type_names_expected_and_found() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = good_run(tmp.path());
    rewrite_part(&hidden_part(&dir), metadata("2"), |b| {
        let step = b
            .column_by_name("step")
            .unwrap()
            .as_any()
            .downcast_ref::<Int32Array>()
            .unwrap()
            .clone();
        let widened: Int64Array = step.iter().map(|v| v.map(i64::from)).collect();
        replace_column(
            &b,
            "step",
            Some(Field::new("step", DataType::Int64, false)),
            Some(Arc::new(widened)),
        )
    });
    match open_err(&dir) {
        LoadError::WrongType {
            column,
            expected,
            got,
            ..
        } => {
            assert_eq!(column, "step");
            assert!(expected.starts_with("i32"), "{expected}");
            assert_eq!(got, "i64");
        }
        other => panic!("expected WrongType, got {other}"),
    }
}

#[test]
fn a_file_listed_in_the_manifest_but_gone_is_named() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = good_run(tmp.path());
    fs::remove_file(hidden_part(&dir)).unwrap();
    match open_err(&dir) {
        LoadError::MissingFile { path } => assert_eq!(path, hidden_part(&dir)),
        other => panic!("expected MissingFile, got {other}"),
    }
}

#[test]
fn a_path_without_runs_is_an_error_naming_it() {
    let tmp = tempfile::tempdir().unwrap();
    let err = Dataset::load(&[tmp.path().to_owned()], false, |_, _| {}).unwrap_err();
    assert!(
        matches!(&err, LoadError::NoRuns { path } if path == tmp.path()),
        "{err}"
    );
}

#[test]
fn bad_runs_are_skipped_and_reported_or_fatal_when_strict() {
    let tmp = tempfile::tempdir().unwrap();
    let good = tmp.path().join("grid/good");
    let bad = tmp.path().join("grid/bad");
    small_spec("good")
        .write(&good, WriterOptions::default())
        .unwrap();
    small_spec("bad")
        .write(&bad, WriterOptions::default())
        .unwrap();
    fs::write(bad.join(MANIFEST_FILE), "not json").unwrap();
    let grid = [tmp.path().join("grid")];

    let lenient = Dataset::load(&grid, false, |_, _| {}).unwrap();
    assert_eq!(lenient.runs.len(), 1);
    assert_eq!(lenient.runs[0].manifest.run_id(), "good");
    assert_eq!(lenient.skipped.len(), 1);
    assert_eq!(lenient.skipped[0].path(), bad.join(MANIFEST_FILE));

    let strict = Dataset::load(&grid, true, |_, _| {}).unwrap_err();
    assert!(
        matches!(strict, LoadError::CorruptManifest { .. }),
        "{strict}"
    );
}

#[test]
fn a_manifest_claiming_more_rows_than_its_files_hold_is_reported_by_inspect_and_analyze() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = good_run(tmp.path());
    let mut held = 0;
    edit_manifest(&dir, |m| {
        held = m["tables"]["hidden"]["rows"].as_u64().unwrap();
        m["tables"]["hidden"]["rows"] = (held + 100).into();
    });
    let expected = format!(
        "table hidden: the manifest says {} rows, its listed files hold {held}",
        held + 100
    );
    let run = Run::open(&dir).unwrap();
    let text = shadowtrace_analyzer::inspect::render_run(&run);
    assert!(text.contains(&expected), "{text}");
    let a = shadowtrace_analyzer::analyze(
        std::slice::from_ref(&dir),
        &[],
        &shadowtrace_analyzer::Options::default(),
        |_, _, _| {},
    )
    .unwrap();
    assert!(
        a.runs[0].notes.iter().any(|n| n.contains(&expected)),
        "{:?}",
        a.runs[0].notes
    );
    let strict = Dataset::load(std::slice::from_ref(&dir), true, |_, _| {}).unwrap_err();
    assert!(strict.to_string().contains(&expected), "{strict}");
    assert_eq!(strict.path(), dir.join(MANIFEST_FILE));
}

/// Flips `bits` bits spread over the data pages of the part at `path` (after
/// its leading magic, before its footer), as a disk or a copy would.
fn flip_data_bits(path: &Path, bits: usize) {
    let mut bytes = fs::read(path).unwrap();
    let n = bytes.len();
    let footer = u32::from_le_bytes(bytes[n - 8..n - 4].try_into().unwrap()) as usize;
    let data = 4..n - 8 - footer;
    assert!(data.len() > bits, "the part has data pages");
    for i in 0..bits {
        let at = data.start + (i * 7919 + 13) % data.len();
        bytes[at] ^= 1 << (i % 8);
    }
    fs::write(path, bytes).unwrap();
}

#[test]
fn flipped_bits_in_a_parts_data_pages_are_refused_naming_the_part() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = good_run(tmp.path());
    let part = hidden_part(&dir);
    flip_data_bits(&part, 12);
    match open_err(&dir) {
        LoadError::ContentHash {
            path,
            expected,
            got,
        } => {
            assert_eq!(path, part);
            assert_ne!(expected, got);
            assert!(expected.starts_with("xxh3-64:") && got.starts_with("xxh3-64:"));
        }
        other => panic!("expected a content hash mismatch, got {other}"),
    }
    // analyze skips it, naming why, rather than reading the flipped values as a whole run.
    let dataset = Dataset::load(std::slice::from_ref(&dir), false, |_, _| {}).unwrap();
    assert!(dataset.runs.is_empty());
    assert_eq!(dataset.skipped.len(), 1);
    let why = dataset.skipped[0].to_string();
    assert!(
        why.contains("bytes changed since its writer closed it"),
        "{why}"
    );
}

#[test]
fn every_listed_part_carries_the_hash_of_its_bytes_and_an_unhashed_one_is_noted() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = good_run(tmp.path());
    let run = Run::open(&dir).unwrap();
    let mut listed = 0;
    for (table, entry) in &run.manifest.tables {
        for file in &entry.files {
            listed += 1;
            let bytes = fs::read(dir.join(file)).unwrap();
            let expected = format!("xxh3-64:{:016x}", xxhash_rust::xxh3::xxh3_64(&bytes));
            assert_eq!(
                entry.file_hashes.get(file),
                Some(&expected),
                "{table}/{file}"
            );
        }
    }
    assert!(listed >= 4, "every table has a part: {listed}");
    assert!(
        run.notes.iter().all(|n| !n.contains("content hash")),
        "{:?}",
        run.notes
    );
    // A manifest from a writer that recorded no hashes reads, and says its bytes are unverified.
    edit_manifest(&dir, |m| {
        for t in m["tables"].as_object_mut().unwrap().values_mut() {
            t.as_object_mut().unwrap().remove("file_hashes");
        }
    });
    let run = Run::open(&dir).unwrap();
    assert!(
        run.notes.iter().any(|n| n.contains(&format!(
            "{listed} listed part file(s) carry no content hash"
        ))),
        "{:?}",
        run.notes
    );
}
