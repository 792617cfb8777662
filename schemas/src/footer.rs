//! The Parquet footer keys every part file carries, and the check a reader
//! runs on them before it trusts a file's columns.
//!
//! A part file says what it is in its key-value metadata, so a file moved out
//! of its run directory still reads: the trace format version (which decides
//! the table's columns), the table and the run. A file without one of them is
//! not a shadowtrace part file, and the reader says which key is missing.

use crate::{
    META_RUN_ID, META_SCHEMA_VERSION, META_TABLE, Table, is_readable, readable_versions_text,
};

/// The footer keys a reader requires, each with what it holds.
pub const FOOTER_KEYS: [(&str, &str); 3] = [
    (
        META_SCHEMA_VERSION,
        "trace format version of the file, as decimal text: 1 or 2; equal to the manifest's schema_version",
    ),
    (
        META_TABLE,
        "the table the file belongs to (hidden, topk, events or logits); equal to its folder",
    ),
    (
        META_RUN_ID,
        "the run the file belongs to; equal to the manifest's run_id and to every row's run_id",
    ),
];

/// What is wrong with a part file's footer keys.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum FooterError {
    /// A required key is absent.
    #[error(
        "footer key {key} is missing (a shadowtrace part file carries {})",
        key_list()
    )]
    MissingKey {
        /// The key.
        key: &'static str,
    },
    /// The version is not one this reader accepts.
    #[error("footer key {key} is {got:?}: unknown trace format version, expected {expected}")]
    UnknownVersion {
        /// The key ([`META_SCHEMA_VERSION`]).
        key: &'static str,
        /// The versions this reader accepts.
        expected: String,
        /// The value found.
        got: String,
    },
    /// A key whose value contradicts where the file sits.
    #[error("footer key {key} is {got:?}, expected {expected:?}")]
    WrongValue {
        /// The key.
        key: &'static str,
        /// The value the run implies.
        expected: String,
        /// The value found.
        got: String,
    },
}

fn key_list() -> String {
    let keys: Vec<&str> = FOOTER_KEYS.iter().map(|(k, _)| *k).collect();
    keys.join(", ")
}

/// Checks a part file's footer keys, read through `lookup`, against the run
/// it sits in: every key present, a readable version equal to the run's
/// (`run_version`, the manifest's), the table of its folder, the run's id.
/// Returns the file's trace format version.
///
/// # Errors
/// The first key that is missing or holds another value; see [`FooterError`].
pub fn check(
    lookup: impl Fn(&str) -> Option<String>,
    table: Table,
    run_id: &str,
    run_version: u32,
) -> Result<u32, FooterError> {
    let values: Vec<String> = FOOTER_KEYS
        .iter()
        .map(|(key, _)| lookup(key).ok_or(FooterError::MissingKey { key }))
        .collect::<Result<_, _>>()?;
    let (version_text, table_name, file_run_id) = (&values[0], &values[1], &values[2]);
    let version = version_text
        .parse::<u32>()
        .ok()
        .filter(|v| is_readable(*v) && v.to_string() == *version_text)
        .ok_or_else(|| FooterError::UnknownVersion {
            key: META_SCHEMA_VERSION,
            expected: readable_versions_text(),
            got: version_text.clone(),
        })?;
    for (key, expected, got) in [
        (META_TABLE, table.name().to_owned(), table_name),
        (META_RUN_ID, run_id.to_owned(), file_run_id),
        (META_SCHEMA_VERSION, run_version.to_string(), version_text),
    ] {
        if *got != expected {
            return Err(FooterError::WrongValue {
                key,
                expected,
                got: got.clone(),
            });
        }
    }
    Ok(version)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lookup<'a>(pairs: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<String> + 'a {
        move |key| {
            pairs
                .iter()
                .find(|(k, _)| *k == key)
                .map(|(_, v)| (*v).to_owned())
        }
    }

    const GOOD: [(&str, &str); 3] = [
        (META_SCHEMA_VERSION, "2"),
        (META_TABLE, "topk"),
        (META_RUN_ID, "r1"),
    ];

    #[test]
    fn a_complete_footer_gives_its_version() {
        assert_eq!(check(lookup(&GOOD), Table::Topk, "r1", 2), Ok(2));
        let v1 = [(META_SCHEMA_VERSION, "1"), GOOD[1], GOOD[2]];
        assert_eq!(check(lookup(&v1), Table::Topk, "r1", 1), Ok(1));
    }

    #[test]
    fn each_missing_key_is_named() {
        for (key, _) in GOOD {
            let pairs: Vec<(&str, &str)> = GOOD.into_iter().filter(|(k, _)| *k != key).collect();
            let err = check(lookup(&pairs), Table::Topk, "r1", 2).unwrap_err();
            assert_eq!(err, FooterError::MissingKey { key });
            assert!(
                err.to_string()
                    .starts_with(&format!("footer key {key} is missing")),
                "{err}"
            );
        }
    }

    #[test]
    fn an_unknown_version_names_the_key_expected_and_got() {
        for got in ["3", "0", "02", "two", ""] {
            let pairs = [(META_SCHEMA_VERSION, got), GOOD[1], GOOD[2]];
            let err = check(lookup(&pairs), Table::Topk, "r1", 2).unwrap_err();
            assert_eq!(
                err,
                FooterError::UnknownVersion {
                    key: META_SCHEMA_VERSION,
                    expected: "1 or 2".to_owned(),
                    got: got.to_owned()
                }
            );
        }
    }

    #[test]
    fn a_file_of_another_table_run_or_version_than_its_run_is_refused() {
        let err = check(lookup(&GOOD), Table::Hidden, "r1", 2).unwrap_err();
        assert!(matches!(err, FooterError::WrongValue { key, .. } if key == META_TABLE));
        let err = check(lookup(&GOOD), Table::Topk, "r2", 2).unwrap_err();
        assert!(matches!(err, FooterError::WrongValue { key, .. } if key == META_RUN_ID));
        let err = check(lookup(&GOOD), Table::Topk, "r1", 1).unwrap_err();
        assert_eq!(
            err.to_string(),
            "footer key shadowtrace.schema_version is \"2\", expected \"1\""
        );
    }
}
