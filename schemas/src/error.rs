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

/// `error` and its causes on one line, each cause said once: `a: b: c`.
///
/// Many messages here end with their cause's text and also name it as their
/// source (`{path}: {source}`), so walking the chain as anyhow's `{:#}` does
/// would print the OS error twice. A cause whose text the line already ends
/// with is not repeated; every other cause is appended.
#[must_use]
pub fn error_line(error: &(dyn std::error::Error + 'static)) -> String {
    let mut line = error.to_string();
    let mut cause = error.source();
    while let Some(c) = cause {
        let text = c.to_string();
        if !line.ends_with(&text) {
            line.push_str(": ");
            line.push_str(&text);
        }
        cause = c.source();
    }
    line
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, thiserror::Error)]
    #[error("reading {path}: {source}")]
    struct Repeats {
        path: &'static str,
        #[source]
        source: std::io::Error,
    }

    #[derive(Debug, thiserror::Error)]
    #[error("opening the model")]
    struct Context(#[source] Repeats);

    #[test]
    fn a_cause_the_message_already_ends_with_is_said_once() {
        let io = std::io::Error::new(std::io::ErrorKind::NotFound, "No such file");
        let error = Context(Repeats {
            path: "p.txt",
            source: io,
        });
        assert_eq!(
            error_line(&error),
            "opening the model: reading p.txt: No such file"
        );
    }

    #[test]
    fn a_cause_the_message_does_not_say_is_appended() {
        #[derive(Debug, thiserror::Error)]
        #[error("reading p.txt")]
        struct Quiet(#[source] std::io::Error);
        let io = std::io::Error::new(std::io::ErrorKind::NotFound, "No such file");
        assert_eq!(error_line(&Quiet(io)), "reading p.txt: No such file");
    }
}
