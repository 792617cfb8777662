use crate::Table;

/// A schema definition that does not hold together.
///
/// The definitions are compiled in, so these errors are defects of the
/// definition files; the tests in this crate parse every one of them.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SchemaError {
    /// A definition file is not valid JSON or does not have the expected shape.
    #[error("schema file {file}: {source}")]
    Parse {
        /// The definition file, relative to `schemas/`.
        file: &'static str,
        /// What serde found.
        #[source]
        source: serde_json::Error,
    },
    /// A column type string outside the grammar.
    #[error(
        "schema file {file}: column {column}: unknown type {got:?}, expected one of {expected}"
    )]
    UnknownType {
        /// The definition file, relative to `schemas/`.
        file: &'static str,
        /// The column.
        column: String,
        /// The type string found.
        got: String,
        /// The accepted type strings.
        expected: &'static str,
    },
    /// A table file that defines another table than its name says.
    #[error("schema file {file}: defines table {got:?}, expected {expected}")]
    WrongTable {
        /// The definition file, relative to `schemas/`.
        file: &'static str,
        /// The table the file should define.
        expected: Table,
        /// The table name found.
        got: String,
    },
}
