//! Table definitions parsed from `schemas/v1/<table>.json` and
//! `schemas/v2/<table>.json`: each version's four tables, v2 taking v1's
//! definition of every table it does not redefine.

use std::fmt;
use std::sync::{Arc, LazyLock};

use arrow_schema::{DataType, Field, Schema, SchemaRef};
use serde::Deserialize;

use crate::{META_SCHEMA_VERSION, META_TABLE, READ_VERSIONS, SCHEMA_VERSION, SchemaError};

/// One of the four tables of a run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Table {
    /// Hidden-state statistics per (step, layer, site, token).
    Hidden,
    /// Indexer top-k selections per (step, layer, query token).
    Topk,
    /// Non-finite occurrences and sentinel checks.
    Events,
    /// Top-N logits per (step, token).
    Logits,
}

impl Table {
    /// Every table, in the order they are listed to users.
    pub const ALL: [Table; 4] = [Table::Hidden, Table::Topk, Table::Events, Table::Logits];

    /// The table's name: its definition file stem and its folder in a run.
    #[must_use]
    pub fn name(self) -> &'static str {
        match self {
            Table::Hidden => "hidden",
            Table::Topk => "topk",
            Table::Events => "events",
            Table::Logits => "logits",
        }
    }

    /// The table with this name, if any.
    #[must_use]
    pub fn from_name(name: &str) -> Option<Table> {
        Table::ALL.into_iter().find(|t| t.name() == name)
    }

    /// The parsed definition in the version producers write ([`SCHEMA_VERSION`]).
    #[must_use]
    pub fn spec(self) -> &'static TableSpec {
        &SPECS[version_index(SCHEMA_VERSION)][self as usize]
    }

    /// The parsed definition in trace format `version`; `None` for a version
    /// no reader of this crate accepts.
    #[must_use]
    pub fn spec_for(self, version: u32) -> Option<&'static TableSpec> {
        READ_VERSIONS
            .contains(&version)
            .then(|| &SPECS[version_index(version)][self as usize])
    }

    /// The Arrow schema of the table as producers write it, with the format
    /// version and table name in its metadata.
    #[must_use]
    pub fn arrow_schema(self) -> SchemaRef {
        ARROW_SCHEMAS[version_index(SCHEMA_VERSION)][self as usize].clone()
    }

    /// The Arrow schema of the table in trace format `version`; `None` for a
    /// version no reader of this crate accepts.
    #[must_use]
    pub fn arrow_schema_for(self, version: u32) -> Option<SchemaRef> {
        READ_VERSIONS
            .contains(&version)
            .then(|| ARROW_SCHEMAS[version_index(version)][self as usize].clone())
    }

    /// The definition file's text in the version producers write.
    #[must_use]
    pub fn definition_json(self) -> &'static str {
        self.source(SCHEMA_VERSION).1
    }

    /// The definition file's text in trace format `version` (v2 keeps v1's
    /// file for every table but `topk`).
    #[must_use]
    pub fn definition_json_for(self, version: u32) -> Option<&'static str> {
        READ_VERSIONS
            .contains(&version)
            .then(|| self.source(version).1)
    }

    fn source(self, version: u32) -> (&'static str, &'static str) {
        match (self, version) {
            (Table::Topk, 1) => ("v1/topk.json", include_str!("../v1/topk.json")),
            (Table::Topk, _) => ("v2/topk.json", include_str!("../v2/topk.json")),
            (Table::Hidden, _) => ("v1/hidden.json", include_str!("../v1/hidden.json")),
            (Table::Events, _) => ("v1/events.json", include_str!("../v1/events.json")),
            (Table::Logits, _) => ("v1/logits.json", include_str!("../v1/logits.json")),
        }
    }

    /// Parses the compiled-in definition producers write, reporting what is
    /// wrong with it.
    ///
    /// # Errors
    /// When the definition file is malformed; see [`SchemaError`].
    pub fn try_spec(self) -> Result<TableSpec, SchemaError> {
        self.try_spec_for(SCHEMA_VERSION)
    }

    /// Parses the compiled-in definition of trace format `version`.
    ///
    /// # Errors
    /// When the definition file is malformed; see [`SchemaError`].
    pub fn try_spec_for(self, version: u32) -> Result<TableSpec, SchemaError> {
        let (file, text) = self.source(version);
        TableSpec::parse(self, file, text)
    }
}

/// Index of a readable version in [`READ_VERSIONS`]; callers check first.
fn version_index(version: u32) -> usize {
    READ_VERSIONS
        .iter()
        .position(|&v| v == version)
        .unwrap_or(READ_VERSIONS.len() - 1)
}

impl TableSpec {
    /// Parses a table definition (`text`, read from `file`) for `table`,
    /// reporting what is wrong with it; never panics, whatever the text.
    ///
    /// # Errors
    /// When the definition is malformed; see [`SchemaError`].
    pub fn parse(table: Table, file: &'static str, text: &str) -> Result<TableSpec, SchemaError> {
        let raw: RawTableSpec =
            serde_json::from_str(text).map_err(|source| SchemaError::Parse { file, source })?;
        if raw.table != table.name() {
            return Err(SchemaError::WrongTable {
                file,
                expected: table,
                got: raw.table,
            });
        }
        let columns = raw
            .columns
            .into_iter()
            .map(|c| {
                let ty = ColumnType::parse(&c.ty).ok_or_else(|| SchemaError::UnknownType {
                    file,
                    column: c.name.clone(),
                    got: c.ty.clone(),
                    expected: ColumnType::GRAMMAR,
                })?;
                Ok(ColumnSpec {
                    name: c.name,
                    ty,
                    nullable: c.nullable,
                    encoding: c.encoding,
                    doc: c.doc,
                })
            })
            .collect::<Result<Vec<_>, SchemaError>>()?;
        Ok(TableSpec {
            table,
            schema_version: raw.schema_version,
            doc: raw.doc,
            key: raw.key,
            columns,
        })
    }
}

impl fmt::Display for Table {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

// Invariant: the definitions are compiled in and `every_definition_parses` in
// this crate's tests parses each one, so a failure here is a build defect.
#[expect(
    clippy::expect_used,
    reason = "compiled-in definitions, parsed by a unit test"
)]
static SPECS: LazyLock<Vec<Vec<TableSpec>>> = LazyLock::new(|| {
    READ_VERSIONS
        .iter()
        .map(|&version| {
            Table::ALL
                .iter()
                .map(|t| {
                    t.try_spec_for(version)
                        .expect("compiled-in table definition parses")
                })
                .collect()
        })
        .collect()
});

static ARROW_SCHEMAS: LazyLock<Vec<Vec<SchemaRef>>> = LazyLock::new(|| {
    READ_VERSIONS
        .iter()
        .enumerate()
        .map(|(i, &version)| {
            SPECS[i]
                .iter()
                .map(|spec| Arc::new(spec.to_arrow(version)))
                .collect()
        })
        .collect()
});

/// A parsed table definition.
#[derive(Debug, Clone, PartialEq)]
pub struct TableSpec {
    /// The table.
    pub table: Table,
    /// Format version that last defined the table (v2 keeps v1's `hidden`,
    /// `events` and `logits`, whose definitions say 1).
    pub schema_version: u32,
    /// What a row is.
    pub doc: String,
    /// Columns that identify a row within a dataset of runs.
    pub key: Vec<String>,
    /// Columns in file order.
    pub columns: Vec<ColumnSpec>,
}

impl TableSpec {
    /// The column with this name, if any.
    #[must_use]
    pub fn column(&self, name: &str) -> Option<&ColumnSpec> {
        self.columns.iter().find(|c| c.name == name)
    }

    /// The Arrow schema, with the format version of the run (`version`) and
    /// the table name in its metadata.
    #[must_use]
    pub fn to_arrow(&self, version: u32) -> Schema {
        let fields: Vec<Field> = self
            .columns
            .iter()
            .map(|c| Field::new(&c.name, c.ty.arrow(), c.nullable))
            .collect();
        let metadata = [
            (META_SCHEMA_VERSION.to_owned(), version.to_string()),
            (META_TABLE.to_owned(), self.table.name().to_owned()),
        ];
        Schema::new(fields).with_metadata(
            metadata
                .into_iter()
                .collect::<std::collections::HashMap<_, _>>(),
        )
    }
}

/// A parsed column definition.
#[derive(Debug, Clone, PartialEq)]
pub struct ColumnSpec {
    /// Column name; also a constant in [`crate::columns`].
    pub name: String,
    /// Logical type.
    pub ty: ColumnType,
    /// Whether the column may hold nulls.
    pub nullable: bool,
    /// Parquet encoding the writers use for it.
    pub encoding: Encoding,
    /// What the column holds.
    pub doc: String,
}

/// The logical column types of the format.
///
/// Signed integers only: Spark and several Parquet readers handle unsigned
/// logical types poorly, and no value here needs the extra bit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ColumnType {
    /// 32-bit signed integer.
    I32,
    /// 64-bit signed integer.
    I64,
    /// 32-bit IEEE float.
    F32,
    /// Boolean.
    Bool,
    /// UTF-8 string.
    Utf8,
    /// List of 32-bit signed integers.
    ListI32,
    /// List of 32-bit IEEE floats.
    ListF32,
    /// List of booleans.
    ListBool,
}

impl ColumnType {
    /// The type strings accepted in definition files.
    pub const GRAMMAR: &'static str = "i32, i64, f32, bool, utf8, list<i32>, list<f32>, list<bool>";

    /// Parses a type string of the definition files.
    #[must_use]
    pub fn parse(s: &str) -> Option<ColumnType> {
        Some(match s {
            "i32" => ColumnType::I32,
            "i64" => ColumnType::I64,
            "f32" => ColumnType::F32,
            "bool" => ColumnType::Bool,
            "utf8" => ColumnType::Utf8,
            "list<i32>" => ColumnType::ListI32,
            "list<f32>" => ColumnType::ListF32,
            "list<bool>" => ColumnType::ListBool,
            _ => return None,
        })
    }

    /// The type string, as written in definition files.
    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            ColumnType::I32 => "i32",
            ColumnType::I64 => "i64",
            ColumnType::F32 => "f32",
            ColumnType::Bool => "bool",
            ColumnType::Utf8 => "utf8",
            ColumnType::ListI32 => "list<i32>",
            ColumnType::ListF32 => "list<f32>",
            ColumnType::ListBool => "list<bool>",
        }
    }

    /// The Arrow type. List items are nullable, as pyarrow's `list_` makes
    /// them, so files from the Rust writer and the Python hooks share a schema.
    #[must_use]
    pub fn arrow(self) -> DataType {
        match self {
            ColumnType::I32 => DataType::Int32,
            ColumnType::I64 => DataType::Int64,
            ColumnType::F32 => DataType::Float32,
            ColumnType::Bool => DataType::Boolean,
            ColumnType::Utf8 => DataType::Utf8,
            ColumnType::ListI32 => {
                DataType::List(Arc::new(Field::new("item", DataType::Int32, true)))
            }
            ColumnType::ListF32 => {
                DataType::List(Arc::new(Field::new("item", DataType::Float32, true)))
            }
            ColumnType::ListBool => {
                DataType::List(Arc::new(Field::new("item", DataType::Boolean, true)))
            }
        }
    }
}

impl fmt::Display for ColumnType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Parquet encodings chosen per column for the data it holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Encoding {
    /// Dictionary: low-cardinality strings (run id, site, mode).
    Dictionary,
    /// Delta binary packed: sorted or slowly varying integers (positions, index lists).
    Delta,
    /// Byte stream split: floats, whose exponent bytes compress well apart,
    /// and small integers such as gaps, whose high bytes are mostly zero.
    ByteStreamSplit,
    /// Plain: values with no exploitable structure.
    Plain,
}

impl Encoding {
    /// The encoding's name, as written in definition files.
    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            Encoding::Dictionary => "dictionary",
            Encoding::Delta => "delta",
            Encoding::ByteStreamSplit => "byte_stream_split",
            Encoding::Plain => "plain",
        }
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawTableSpec {
    table: String,
    schema_version: u32,
    doc: String,
    key: Vec<String>,
    columns: Vec<RawColumnSpec>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawColumnSpec {
    name: String,
    #[serde(rename = "type")]
    ty: String,
    nullable: bool,
    encoding: Encoding,
    doc: String,
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every table definition of every readable version.
    fn every_spec() -> impl Iterator<Item = (u32, &'static TableSpec)> {
        READ_VERSIONS.into_iter().flat_map(|v| {
            Table::ALL
                .into_iter()
                .filter_map(move |t| t.spec_for(v).map(|s| (v, s)))
        })
    }

    #[test]
    fn every_definition_parses_and_names_its_table() {
        for version in READ_VERSIONS {
            for table in Table::ALL {
                let spec = table
                    .try_spec_for(version)
                    .unwrap_or_else(|e| panic!("{e}"));
                assert_eq!(spec.table, table);
                assert!(
                    spec.schema_version <= version,
                    "{table} v{version}: defined by v{}",
                    spec.schema_version
                );
                assert!(!spec.columns.is_empty());
            }
        }
    }

    #[test]
    fn v2_redefines_topk_and_keeps_v1_for_the_other_tables() {
        assert_eq!(SCHEMA_VERSION, 2);
        assert_eq!(Table::Topk.spec().schema_version, 2);
        assert_eq!(Table::Topk.spec_for(1).map(|s| s.schema_version), Some(1));
        for table in [Table::Hidden, Table::Events, Table::Logits] {
            assert_eq!(table.spec_for(1), table.spec_for(2), "{table}");
        }
        assert_eq!(Table::Topk.spec_for(3), None);
        assert_eq!(Table::Topk.spec_for(0), None);
    }

    #[test]
    fn every_key_column_exists_and_is_declared_once() {
        for (_, spec) in every_spec() {
            let table = spec.table;
            for key in &spec.key {
                assert!(
                    spec.column(key).is_some(),
                    "{table}: key column {key} is not a column"
                );
            }
            let mut names: Vec<&str> = spec.columns.iter().map(|c| c.name.as_str()).collect();
            names.sort_unstable();
            let before = names.len();
            names.dedup();
            assert_eq!(before, names.len(), "{table}: duplicate column name");
        }
    }

    #[test]
    fn every_table_starts_with_the_run_id() {
        for (version, spec) in every_spec() {
            assert_eq!(
                spec.columns[0].name,
                crate::columns::RUN_ID,
                "{} v{version}",
                spec.table
            );
        }
    }

    #[test]
    fn encodings_fit_their_column_types() {
        for (_, spec) in every_spec() {
            let table = spec.table;
            for c in &spec.columns {
                let fits = match c.encoding {
                    Encoding::Dictionary => c.ty == ColumnType::Utf8,
                    Encoding::Delta => matches!(
                        c.ty,
                        ColumnType::I32 | ColumnType::I64 | ColumnType::ListI32
                    ),
                    Encoding::ByteStreamSplit => matches!(
                        c.ty,
                        ColumnType::F32
                            | ColumnType::ListF32
                            | ColumnType::I32
                            | ColumnType::ListI32
                    ),
                    Encoding::Plain => true,
                };
                assert!(
                    fits,
                    "{table}.{}: {} does not fit {}",
                    c.name,
                    c.encoding.as_str(),
                    c.ty
                );
            }
        }
    }

    #[test]
    fn type_strings_round_trip() {
        for s in ColumnType::GRAMMAR.split(", ") {
            assert_eq!(ColumnType::parse(s).map(ColumnType::as_str), Some(s));
        }
        assert_eq!(ColumnType::parse("u32"), None);
    }

    #[test]
    fn arrow_schema_carries_version_and_table_name() {
        let schema = Table::Topk.arrow_schema();
        assert_eq!(schema.metadata()[META_SCHEMA_VERSION], "2");
        assert_eq!(schema.metadata()[META_TABLE], "topk");
        // v2 writes v1's hidden definition under its own version.
        assert_eq!(
            Table::Hidden.arrow_schema().metadata()[META_SCHEMA_VERSION],
            "2"
        );
        let v1 = Table::Hidden.arrow_schema_for(1).unwrap();
        assert_eq!(v1.metadata()[META_SCHEMA_VERSION], "1");
        assert_eq!(v1.fields(), Table::Hidden.arrow_schema().fields());
    }

    #[test]
    fn list_bool_reads_as_an_arrow_list_of_booleans() {
        let ty = ColumnType::parse("list<bool>").unwrap();
        assert_eq!(
            ty.arrow(),
            DataType::List(Arc::new(Field::new("item", DataType::Boolean, true)))
        );
    }
}
