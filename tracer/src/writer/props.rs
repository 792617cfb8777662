//! Parquet writer properties per table: encodings from the definitions,
//! zstd, and row groups sized for later scans.

use parquet::arrow::ArrowSchemaConverter;
use parquet::basic::{Compression, Encoding as ParquetEncoding, ZstdLevel};
use parquet::errors::ParquetError;
use parquet::file::metadata::KeyValue;
use parquet::file::properties::WriterProperties;
use shadowtrace_schemas::{Encoding, META_RUN_ID, META_SCHEMA_VERSION, META_TABLE, Table};

/// zstd level 3: most of level 9's ratio on these columns at a fraction of the CPU.
const ZSTD_LEVEL: i32 = 3;

/// zstd level 1 for v2's top-k table: its gap-coded key lists compress
/// better at level 1 than at 3 or 9 (arrow-rs, `benches/topk_bytes.rs`,
/// 2048 of 8192 random keys, 95% overlap: full lists stored 1115.6 bytes/row
/// at level 1, 1231.1 at 3, 1203.5 at 9; the default tier 256.0, 254.8 and
/// 252.6), as pyarrow measured (`schemas/v2/README.md`).
const ZSTD_LEVEL_TOPK_V2: i32 = 1;

/// The zstd level of a table's part files in trace format `version`.
#[must_use]
pub fn zstd_level(table: Table, version: u32) -> i32 {
    if table == Table::Topk && version >= 2 {
        ZSTD_LEVEL_TOPK_V2
    } else {
        ZSTD_LEVEL
    }
}

/// Rows per row group in trace format `version`. A row group is the unit a
/// scan skips or reads; each is sized to hold tens of MB uncompressed, so one
/// layer of a long prefill is a handful of row groups and statistics-based
/// skipping still has grain.
#[must_use]
pub fn row_group_rows(table: Table, version: u32) -> usize {
    match table {
        // v1: one row holds two 2048-entry index lists (about 16 KiB raw).
        Table::Topk if version < 2 => 4096,
        // v2: a summary and the differences, a few hundred bytes at 95%
        // overlap; a sampled full list adds 8 KiB.
        Table::Topk => 1 << 16,
        // One row is about 100 bytes raw.
        Table::Hidden => 1 << 20,
        Table::Events => 1 << 16,
        // One row holds two top-N lists.
        Table::Logits => 1 << 16,
    }
}

/// Writer properties for one table's part files in trace format `version`.
///
/// # Errors
/// When the version is unknown or the table's Arrow schema has no Parquet
/// form (a defect).
pub fn writer_properties(
    table: Table,
    version: u32,
    run_id: &str,
    extra: Vec<KeyValue>,
) -> Result<WriterProperties, ParquetError> {
    let (Some(spec), Some(schema)) = (table.spec_for(version), table.arrow_schema_for(version))
    else {
        return Err(ParquetError::General(format!(
            "trace format version {version} is not defined"
        )));
    };
    let descriptor = ArrowSchemaConverter::new().convert(&schema)?;
    let mut metadata = vec![
        KeyValue::new(META_SCHEMA_VERSION.to_owned(), version.to_string()),
        KeyValue::new(META_TABLE.to_owned(), table.name().to_owned()),
        KeyValue::new(META_RUN_ID.to_owned(), run_id.to_owned()),
    ];
    metadata.extend(extra);
    let mut builder = WriterProperties::builder()
        .set_compression(Compression::ZSTD(ZstdLevel::try_new(zstd_level(
            table, version,
        ))?))
        .set_dictionary_enabled(false)
        .set_max_row_group_row_count(Some(row_group_rows(table, version)))
        .set_key_value_metadata(Some(metadata))
        .set_created_by(format!("shadowtrace-tracer {}", env!("CARGO_PKG_VERSION")));
    // Leaf columns are addressed by their full path (lists nest their values
    // one level down), so match each leaf to the top-level column it belongs to.
    for leaf in descriptor.columns() {
        let path = leaf.path().clone();
        let Some(column) = path.parts().first().and_then(|name| spec.column(name)) else {
            continue;
        };
        builder = match column.encoding {
            Encoding::Dictionary => builder.set_column_dictionary_enabled(path, true),
            Encoding::Delta => {
                builder.set_column_encoding(path, ParquetEncoding::DELTA_BINARY_PACKED)
            }
            Encoding::ByteStreamSplit => {
                builder.set_column_encoding(path, ParquetEncoding::BYTE_STREAM_SPLIT)
            }
            Encoding::Plain => builder.set_column_encoding(path, ParquetEncoding::PLAIN),
        };
    }
    Ok(builder.build())
}
