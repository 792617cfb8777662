//! The environment variables that switch and shape tracing, defined once in
//! `schemas/v1/env.json` and read by the Rust tracer and the Python hooks.
//!
//! [`resolve`] turns the process environment (or any lookup) into canonical
//! JSON values, one per variable, defaults applied; the Python hooks produce
//! the same JSON from the same definitions, and a test holds the two to it
//! over a corpus of valid and invalid values for every variable.
//!
//! What each type accepts is written in the file (`types`) and nothing more:
//! only ASCII whitespace is trimmed, numbers are ASCII digits (no `+`, no
//! `_`, no other scripts' digits, no `nan` or `inf`), and an integer that
//! does not fit its type is refused, not wrapped. Rust's and Python's own
//! number parsers accept different strings, so neither is used alone.

use std::collections::BTreeMap;
use std::sync::LazyLock;

use serde::Deserialize;
use serde_json::{Value, json};

use crate::{SchemaError, vocabulary};

/// The definitions file, as shipped in `schemas/v1/`.
pub const ENV_JSON: &str = include_str!("../v1/env.json");

/// One variable's definition.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EnvVar {
    /// Its name, for example `SHADOWTRACE_LAYERS`.
    pub name: String,
    /// How its value reads: bool, path, layers, sites, enum, modes, tokens,
    /// tags, int or float.
    #[serde(rename = "type")]
    pub ty: String,
    /// The value when unset.
    pub default: String,
    /// The allowed values of an enum.
    #[serde(default)]
    pub values: Vec<String>,
    /// The smallest allowed number.
    #[serde(default)]
    pub min: Option<f64>,
    /// What it does.
    pub doc: String,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct EnvFile {
    #[allow(
        dead_code,
        reason = "checked by the tests, kept in the file for readers"
    )]
    schema_version: u32,
    #[allow(dead_code, reason = "documentation for readers of the file")]
    doc: String,
    #[allow(
        dead_code,
        reason = "what each type accepts, for readers; a test checks every variable's type is described"
    )]
    types: BTreeMap<String, String>,
    /// Variables that no longer exist, and what replaced them: set, they are an error
    /// (silently ignoring one would trace otherwise than its user asked).
    #[serde(default)]
    retired: BTreeMap<String, String>,
    /// The variables of the project's other programs (tests, notebooks,
    /// benchmarks): no tracing variable, never warned about. A name ending in
    /// `*` stands for every name it starts.
    #[serde(default)]
    not_tracing: BTreeMap<String, String>,
    variables: Vec<EnvVar>,
}

/// Parses the compiled-in definitions.
///
/// # Errors
/// When the file is malformed.
pub fn try_env_vars() -> Result<Vec<EnvVar>, SchemaError> {
    env_file().map(|f| f.variables)
}

fn env_file() -> Result<EnvFile, SchemaError> {
    parse_env_file(ENV_JSON)
}

fn parse_env_file(text: &str) -> Result<EnvFile, SchemaError> {
    serde_json::from_str::<EnvFile>(text).map_err(|source| SchemaError::Parse {
        file: "v1/env.json",
        source,
    })
}

/// Parses an environment definitions file (`env.json`'s layout): its
/// variables, or what is wrong with it; never panics, whatever the text.
///
/// # Errors
/// When the text is not a definitions file.
pub fn parse_env_vars(text: &str) -> Result<Vec<EnvVar>, SchemaError> {
    parse_env_file(text).map(|f| f.variables)
}

// Invariant: compiled in and parsed by `definitions_parse_with_known_types` below.
#[expect(
    clippy::expect_used,
    reason = "compiled-in definition, parsed by a unit test"
)]
static ENV_VARS: LazyLock<Vec<EnvVar>> =
    LazyLock::new(|| try_env_vars().expect("compiled-in env definitions parse"));

// Invariant: as ENV_VARS.
#[expect(
    clippy::expect_used,
    reason = "compiled-in definition, parsed by a unit test"
)]
static RETIRED: LazyLock<Retired> = LazyLock::new(|| {
    Retired(
        env_file()
            .expect("compiled-in env definitions parse")
            .retired,
    )
});

struct Retired(BTreeMap<String, String>);

// Invariant: as ENV_VARS.
#[expect(
    clippy::expect_used,
    reason = "compiled-in definition, parsed by a unit test"
)]
static NOT_TRACING: LazyLock<Vec<String>> = LazyLock::new(|| {
    env_file()
        .expect("compiled-in env definitions parse")
        .not_tracing
        .into_keys()
        .collect()
});

/// The prefix every tracing variable's name starts with.
const PREFIX: &str = "SHADOWTRACE_";

/// A `SHADOWTRACE_*` name set in the environment that is no variable: most
/// often a typo (`SHADOWTRACE_LAYER`), which would otherwise trace with the
/// default silently.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnknownName {
    /// The name as set.
    pub name: String,
    /// The variable whose name is closest to it (edit distance; the first in
    /// the definitions file on a tie).
    pub closest: String,
}

impl std::fmt::Display for UnknownName {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} is no shadowtrace variable and is ignored: did you mean {}?",
            self.name, self.closest
        )
    }
}

/// The names among `names` (for the process: `std::env::vars_os()`'s) that
/// start with `SHADOWTRACE_` and are neither a variable, a retired one, nor
/// one of the project's other programs' (`not_tracing`), each with the
/// variable closest to it, in the order given, each name once.
#[must_use]
pub fn unknown_names<'a>(names: impl IntoIterator<Item = &'a str>) -> Vec<UnknownName> {
    let mut out: Vec<UnknownName> = Vec::new();
    for name in names {
        let known = env_vars().iter().any(|v| v.name == name)
            || RETIRED.0.contains_key(name)
            || NOT_TRACING
                .iter()
                .any(|other| match other.strip_suffix('*') {
                    Some(prefix) => name.starts_with(prefix),
                    None => other == name,
                });
        if !name.starts_with(PREFIX) || known || out.iter().any(|u| u.name == name) {
            continue;
        }
        let closest = env_vars()
            .iter()
            .min_by_key(|v| edit_distance(&v.name, name))
            .map_or_else(String::new, |v| v.name.clone());
        out.push(UnknownName {
            name: name.to_owned(),
            closest,
        });
    }
    out
}

/// Levenshtein distance between `a` and `b`, in characters.
fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut previous: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut current = vec![i + 1];
        for (j, cb) in b.iter().enumerate() {
            let substitute = previous[j] + usize::from(ca != *cb);
            current.push(substitute.min(previous[j + 1] + 1).min(current[j] + 1));
        }
        previous = current;
    }
    previous[b.len()]
}

/// Every variable, in the order of the definitions file.
#[must_use]
pub fn env_vars() -> &'static [EnvVar] {
    &ENV_VARS
}

/// A value that does not read as its variable's type.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{name}={got:?}: expected {expected}")]
pub struct EnvError {
    /// The variable.
    pub name: String,
    /// Its value.
    pub got: String,
    /// What it should look like.
    pub expected: String,
}

/// Every variable's canonical value, defaults applied, read through
/// `lookup` (for the process: `|name| std::env::var(name).ok()`).
///
/// # Errors
/// The first variable whose value does not read as its type.
pub fn resolve(
    lookup: impl Fn(&str) -> Option<String>,
) -> Result<BTreeMap<String, Value>, EnvError> {
    for (name, instead) in &RETIRED.0 {
        if let Some(got) = lookup(name) {
            return Err(EnvError {
                name: name.clone(),
                got,
                expected: instead.clone(),
            });
        }
    }
    env_vars()
        .iter()
        .map(|var| {
            let raw = lookup(&var.name).unwrap_or_else(|| var.default.clone());
            parse(var, trim(&raw))
                .map(|v| (var.name.clone(), v))
                .map_err(|expected| EnvError {
                    name: var.name.clone(),
                    got: raw.clone(),
                    expected,
                })
        })
        .collect()
}

/// `s` without leading and trailing ASCII whitespace (space, tab, line
/// feed, form feed, carriage return), the only whitespace a value loses.
fn trim(s: &str) -> &str {
    s.trim_matches(|c: char| c.is_ascii_whitespace())
}

/// One or more ASCII digits.
fn digits(s: &str) -> bool {
    !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit())
}

/// An integer as `types.int` defines it: `-?D+`.
fn is_integer(s: &str) -> bool {
    digits(s.strip_prefix('-').unwrap_or(s))
}

/// A number as `types.float` defines it: `-?(D+(.D*)?|.D+)([eE][+-]?D+)?`.
fn is_decimal(s: &str) -> bool {
    let s = s.strip_prefix('-').unwrap_or(s);
    let (mantissa, exponent) = match s.find(['e', 'E']) {
        Some(at) => (&s[..at], Some(&s[at + 1..])),
        None => (s, None),
    };
    let mantissa = match mantissa.split_once('.') {
        Some((whole, fraction)) => {
            (digits(whole) || whole.is_empty())
                && (digits(fraction) || fraction.is_empty())
                && !(whole.is_empty() && fraction.is_empty())
        }
        None => digits(mantissa),
    };
    mantissa && exponent.is_none_or(|e| digits(e.strip_prefix(['+', '-']).unwrap_or(e)))
}

/// "an integer >= 1", or "an integer" without a minimum.
fn number_expected(what: &str, min: Option<f64>) -> String {
    min.map_or_else(|| what.to_owned(), |m| format!("{what} >= {m}"))
}

/// A layer `N` or an inclusive range `N-M` as the `layers` and `grafts` types
/// write it: ASCII digits that fit an unsigned 32-bit integer, each side
/// trimmed of ASCII whitespace, `N <= M`; `None` for anything else.
#[must_use]
pub fn layer_range(text: &str) -> Option<[u32; 2]> {
    let (a, b) = text.split_once('-').unwrap_or((text, text));
    let (a, b) = (trim(a), trim(b));
    if !(digits(a) && digits(b)) {
        return None;
    }
    match (a.parse::<u32>(), b.parse::<u32>()) {
        (Ok(a), Ok(b)) if a <= b => Some([a, b]),
        _ => None,
    }
}

/// The sites a graft may name (`SHADOWTRACE_GRAFT`).
const GRAFT_SITES: [&str; 4] = ["indexer", "attn_out", "mlp_out", "layer_out"];

/// One value in canonical JSON, or what was expected instead.
fn parse(var: &EnvVar, raw: &str) -> Result<Value, String> {
    let list = |raw: &str| -> Vec<String> {
        raw.split(',')
            .map(trim)
            .filter(|s| !s.is_empty())
            .map(str::to_owned)
            .collect()
    };
    match var.ty.as_str() {
        "bool" => match raw.to_ascii_lowercase().as_str() {
            "1" | "true" | "yes" | "on" => Ok(json!(true)),
            "" | "0" | "false" | "no" | "off" => Ok(json!(false)),
            _ => Err("1/true/yes/on or 0/false/no/off".to_owned()),
        },
        "path" if !raw.is_empty() => Ok(json!(raw)),
        "path" => Err("a directory path".to_owned()),
        "enum" if var.values.iter().any(|v| v == raw) => Ok(json!(raw)),
        "enum" => Err(format!("one of {}", var.values.join(", "))),
        "int" => match raw.parse::<i64>() {
            Ok(n) if is_integer(raw) && var.min.is_none_or(|m| n as f64 >= m) => Ok(json!(n)),
            _ => Err(number_expected("an integer", var.min)),
        },
        "float" => match raw.parse::<f64>() {
            Ok(x) if is_decimal(raw) && x.is_finite() && var.min.is_none_or(|m| x >= m) => {
                Ok(json!(x))
            }
            _ => Err(number_expected("a number", var.min)),
        },
        "layers" if raw == "all" => Ok(json!("all")),
        "layers" => {
            let mut ranges = list(raw)
                .iter()
                .map(|part| layer_range(part).ok_or(()))
                .collect::<Result<Vec<[u32; 2]>, ()>>()
                .map_err(|()| "all, or layers and ranges such as 0-3,10".to_owned())?;
            if ranges.is_empty() {
                return Err("all, or layers and ranges such as 0-3,10".to_owned());
            }
            ranges.sort_unstable();
            Ok(json!(ranges))
        }
        "sites" if raw == "all" => Ok(json!("all")),
        "sites" => {
            let known: Vec<&str> = vocabulary().sites.iter().map(|s| s.name.as_str()).collect();
            let sites = list(raw);
            if sites.is_empty() || sites.iter().any(|s| !known.contains(&s.as_str())) {
                return Err(format!("all, or a comma list of {}", known.join(", ")));
            }
            Ok(json!(sites))
        }
        "modes" => {
            let modes = list(raw);
            let known = &vocabulary().shadow_modes;
            if modes.is_empty() || modes.iter().any(|m| !known.contains(m)) {
                return Err(format!("a comma list of {}", known.join(", ")));
            }
            let mut unique = Vec::new();
            for m in modes {
                if !unique.contains(&m) {
                    unique.push(m);
                }
            }
            Ok(json!(unique))
        }
        "tokens" => {
            let expected = || "all, every:N or last:N with N >= 1".to_owned();
            if raw == "all" {
                return Ok(json!({"kind": "all"}));
            }
            let (kind, n) = raw.split_once(':').ok_or_else(expected)?;
            let n = trim(n);
            match (kind, n.parse::<u64>()) {
                ("every" | "last", Ok(count)) if digits(n) && count >= 1 => {
                    Ok(json!({"kind": kind, "n": count}))
                }
                _ => Err(expected()),
            }
        }
        "topk_lists" => {
            let expected = || "none, all or every:N with N >= 1".to_owned();
            if raw == "none" || raw == "all" {
                return Ok(json!({"kind": raw}));
            }
            let (kind, n) = raw.split_once(':').ok_or_else(expected)?;
            let n = trim(n);
            match (kind, n.parse::<u64>()) {
                ("every", Ok(count)) if digits(n) && count >= 1 => {
                    Ok(json!({"kind": kind, "n": count}))
                }
                _ => Err(expected()),
            }
        }
        "tags" => {
            let expected = || "comma-separated key=value pairs with non-empty keys".to_owned();
            let mut tags = serde_json::Map::new();
            for pair in list(raw) {
                let (k, v) = pair.split_once('=').ok_or_else(expected)?;
                if trim(k).is_empty() {
                    return Err(expected());
                }
                tags.insert(trim(k).to_owned(), json!(trim(v)));
            }
            Ok(Value::Object(tags))
        }
        "grafts" => {
            let expected = || {
                "empty, or a comma list of SITE, SITE@N or SITE@N-M with SITE one of indexer, \
                 attn_out, mlp_out, layer_out and N <= M"
                    .to_owned()
            };
            list(raw)
                .iter()
                .map(|part| {
                    let (site, layers) = part
                        .split_once('@')
                        .map_or((part.as_str(), None), |(s, l)| (s, Some(l)));
                    let site = trim(site);
                    if !GRAFT_SITES.contains(&site) {
                        return Err(expected());
                    }
                    let layers = match layers {
                        None => json!("all"),
                        Some(text) => json!(layer_range(text).ok_or_else(expected)?),
                    };
                    Ok(json!({"site": site, "layers": layers}))
                })
                .collect::<Result<Vec<Value>, String>>()
                .map(Value::Array)
        }
        other => Err(format!(
            "a value of the unknown type {other} (a defect in env.json)"
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let map: BTreeMap<String, String> = pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        move |name| map.get(name).cloned()
    }

    #[test]
    fn definitions_parse_with_known_types_and_valid_defaults() {
        let vars = try_env_vars().unwrap();
        assert_eq!(vars[0].name, "SHADOWTRACE");
        let resolved = resolve(|_| None).unwrap();
        assert_eq!(
            resolved.len(),
            vars.len(),
            "every default reads as its type"
        );
    }

    #[test]
    fn every_type_in_use_is_described_in_the_file() {
        let file = env_file().unwrap();
        for var in &file.variables {
            assert!(file.types.contains_key(&var.ty), "{}: {}", var.name, var.ty);
        }
    }

    #[test]
    fn numbers_are_ascii_decimals_and_nothing_else() {
        for good in ["0", "12", "-3", "0.5", ".5", "5.", "1e3", "1E-3", "-.5e+2"] {
            assert!(is_decimal(good), "{good}");
        }
        for bad in [
            "", ".", "-", "+1", "1_0", "nan", "inf", "1e", "1.2.3", "\u{663}", "0x10", " 1",
        ] {
            assert!(!is_decimal(bad), "{bad}");
        }
        assert!(is_integer("-12") && !is_integer("+12") && !is_integer("1_000"));
    }

    #[test]
    fn unset_means_off_with_documented_defaults() {
        let r = resolve(|_| None).unwrap();
        assert_eq!(r["SHADOWTRACE"], json!(false));
        assert_eq!(r["SHADOWTRACE_LAYERS"], json!("all"));
        assert_eq!(r["SHADOWTRACE_MODE"], json!(["local"]));
        assert_eq!(r["SHADOWTRACE_TOKENS"], json!({"kind": "all"}));
        assert_eq!(r["SHADOWTRACE_QUEUE_MB"], json!(256));
        assert_eq!(r["SHADOWTRACE_TOPK_LISTS"], json!({"kind": "none"}));
        assert_eq!(r["SHADOWTRACE_SHADOW_SCOPE"], json!("layer"));
    }

    #[test]
    fn shadow_scope_reads_as_layer_or_indexer() {
        let read = |v: &str| resolve(with(&[("SHADOWTRACE_SHADOW_SCOPE", v)]));
        assert_eq!(
            read(" indexer ").unwrap()["SHADOWTRACE_SHADOW_SCOPE"],
            json!("indexer")
        );
        assert_eq!(
            read("layer").unwrap()["SHADOWTRACE_SHADOW_SCOPE"],
            json!("layer")
        );
        let err = read("Indexer").unwrap_err();
        assert_eq!(err.expected, "one of layer, indexer");
    }

    #[test]
    fn topk_lists_read_as_none_all_or_every_n() {
        let read = |v: &str| resolve(with(&[("SHADOWTRACE_TOPK_LISTS", v)]));
        assert_eq!(
            read(" every:64 ").unwrap()["SHADOWTRACE_TOPK_LISTS"],
            json!({"kind": "every", "n": 64})
        );
        assert_eq!(
            read("all").unwrap()["SHADOWTRACE_TOPK_LISTS"],
            json!({"kind": "all"})
        );
        for bad in [
            "every:0", "every:", "last:4", "ALL", "every:+4", "every :4", "some",
        ] {
            let err = read(bad).unwrap_err();
            assert_eq!(err.expected, "none, all or every:N with N >= 1", "{bad}");
        }
    }

    #[test]
    fn grafts_read_as_sites_with_layer_ranges_and_nothing_else() {
        let read = |v: &str| resolve(with(&[("SHADOWTRACE_GRAFT", v)]));
        assert_eq!(
            resolve(|_| None).unwrap()["SHADOWTRACE_GRAFT"],
            json!([]),
            "unset: no graft"
        );
        assert_eq!(
            read(" indexer@20-23, layer_out , mlp_out@ 3 ").unwrap()["SHADOWTRACE_GRAFT"],
            json!([
                {"site": "indexer", "layers": [20, 23]},
                {"site": "layer_out", "layers": "all"},
                {"site": "mlp_out", "layers": [3, 3]},
            ])
        );
        for bad in [
            "kv@1",
            "indexer@3-1",
            "indexer@",
            "indexer@-3",
            "indexer@+3",
            "Indexer",
            "indexer@1-2-3",
            "indexer@4294967296",
            "indexer@x",
        ] {
            let err = read(bad).unwrap_err();
            assert!(
                err.expected.starts_with("empty, or a comma list of SITE"),
                "{bad}"
            );
        }
    }

    #[test]
    fn values_read_as_their_types() {
        let r = resolve(with(&[
            ("SHADOWTRACE", "1"),
            ("SHADOWTRACE_LAYERS", "10, 0-3,76-77"),
            ("SHADOWTRACE_SITES", "layer_out,indexer"),
            ("SHADOWTRACE_MODE", "free,local,free"),
            ("SHADOWTRACE_TOKENS", "last:512"),
            ("SHADOWTRACE_TAGS", "prompt_kind=tool, ticket=12"),
            ("SHADOWTRACE_BOUNDARY_BAND", "0.5"),
        ]))
        .unwrap();
        assert_eq!(r["SHADOWTRACE"], json!(true));
        assert_eq!(r["SHADOWTRACE_LAYERS"], json!([[0, 3], [10, 10], [76, 77]]));
        assert_eq!(r["SHADOWTRACE_SITES"], json!(["layer_out", "indexer"]));
        assert_eq!(r["SHADOWTRACE_MODE"], json!(["free", "local"]));
        assert_eq!(r["SHADOWTRACE_TOKENS"], json!({"kind": "last", "n": 512}));
        assert_eq!(
            r["SHADOWTRACE_TAGS"],
            json!({"prompt_kind": "tool", "ticket": "12"})
        );
        assert_eq!(r["SHADOWTRACE_BOUNDARY_BAND"], json!(0.5));
    }

    #[test]
    fn an_unknown_name_is_reported_once_with_the_closest_variable() {
        let unknown = unknown_names([
            "SHADOWTRACE_LAYER",
            "PATH",
            "SHADOWTRACE_LAYERS",
            "SHADOWTRACE_LAYER",
            "SHADOWTRACE_SHADOW_SCOPES",
            "SHADOWTRACE_DIRECTORY",
        ]);
        assert_eq!(
            unknown
                .iter()
                .map(|u| (u.name.as_str(), u.closest.as_str()))
                .collect::<Vec<_>>(),
            [
                ("SHADOWTRACE_LAYER", "SHADOWTRACE_LAYERS"),
                ("SHADOWTRACE_SHADOW_SCOPES", "SHADOWTRACE_SHADOW_SCOPE"),
                ("SHADOWTRACE_DIRECTORY", "SHADOWTRACE_DIR"),
            ]
        );
        assert_eq!(
            unknown[0].to_string(),
            "SHADOWTRACE_LAYER is no shadowtrace variable and is ignored: did you mean \
             SHADOWTRACE_LAYERS?"
        );
    }

    #[test]
    fn the_other_programs_and_retired_names_are_not_unknown() {
        assert_eq!(
            unknown_names([
                "SHADOWTRACE",
                "SHADOWTRACE_BIN_DIR",
                "SHADOWTRACE_BENCH_REPEATS",
                "SHADOWTRACE_QUEUE_CAPACITY",
                "SHADOWTRACEX",
            ]),
            []
        );
    }

    #[test]
    fn edit_distance_counts_insertions_deletions_and_substitutions() {
        assert_eq!(edit_distance("LAYERS", "LAYER"), 1);
        assert_eq!(edit_distance("kitten", "sitting"), 3);
        assert_eq!(edit_distance("", "abc"), 3);
        assert_eq!(edit_distance("same", "same"), 0);
    }

    #[test]
    fn a_bad_value_names_the_variable_what_it_got_and_what_it_expected() {
        let err = resolve(with(&[("SHADOWTRACE_LAYERS", "3-1")])).unwrap_err();
        assert_eq!(
            err.to_string(),
            "SHADOWTRACE_LAYERS=\"3-1\": expected all, or layers and ranges such as 0-3,10"
        );
        let err = resolve(with(&[("SHADOWTRACE_SHADOW", "fp16")])).unwrap_err();
        assert_eq!(err.expected, "one of fp32, bf16, none");
        let err = resolve(with(&[("SHADOWTRACE_SITES", "attn")])).unwrap_err();
        assert!(
            err.expected.contains("layer_in, indexer, attn_out"),
            "{err}"
        );
        assert!(resolve(with(&[("SHADOWTRACE_QUEUE_MB", "0")])).is_err());
        let retired = resolve(with(&[("SHADOWTRACE_QUEUE_CAPACITY", "4096")])).unwrap_err();
        assert_eq!(retired.name, "SHADOWTRACE_QUEUE_CAPACITY");
        assert!(
            retired.expected.contains("SHADOWTRACE_QUEUE_MB"),
            "{retired}"
        );
        assert!(resolve(with(&[("SHADOWTRACE", "maybe")])).is_err());
    }
}
