//! The environment variables that switch and shape tracing, defined once in
//! `schemas/v1/env.json` and read by the Rust tracer and the Python hooks.
//!
//! [`resolve`] turns the process environment (or any lookup) into canonical
//! JSON values, one per variable, defaults applied; the Python hooks produce
//! the same JSON from the same definitions, and a test holds the two to it.

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
    variables: Vec<EnvVar>,
}

/// Parses the compiled-in definitions.
///
/// # Errors
/// When the file is malformed.
pub fn try_env_vars() -> Result<Vec<EnvVar>, SchemaError> {
    serde_json::from_str::<EnvFile>(ENV_JSON)
        .map(|f| f.variables)
        .map_err(|source| SchemaError::Parse {
            file: "v1/env.json",
            source,
        })
}

// Invariant: compiled in and parsed by `definitions_parse_with_known_types` below.
#[expect(
    clippy::expect_used,
    reason = "compiled-in definition, parsed by a unit test"
)]
static ENV_VARS: LazyLock<Vec<EnvVar>> =
    LazyLock::new(|| try_env_vars().expect("compiled-in env definitions parse"));

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
    env_vars()
        .iter()
        .map(|var| {
            let raw = lookup(&var.name).unwrap_or_else(|| var.default.clone());
            parse(var, raw.trim())
                .map(|v| (var.name.clone(), v))
                .map_err(|expected| EnvError {
                    name: var.name.clone(),
                    got: raw.clone(),
                    expected,
                })
        })
        .collect()
}

/// One value in canonical JSON, or what was expected instead.
fn parse(var: &EnvVar, raw: &str) -> Result<Value, String> {
    let list = |raw: &str| -> Vec<String> {
        raw.split(',')
            .map(str::trim)
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
            Ok(n) if var.min.is_none_or(|m| n as f64 >= m) => Ok(json!(n)),
            _ => Err(format!("an integer >= {}", var.min.unwrap_or(f64::MIN))),
        },
        "float" => match raw.parse::<f64>() {
            Ok(x) if x.is_finite() && var.min.is_none_or(|m| x >= m) => Ok(json!(x)),
            _ => Err(format!("a number >= {}", var.min.unwrap_or(f64::MIN))),
        },
        "layers" if raw == "all" => Ok(json!("all")),
        "layers" => {
            let mut ranges = list(raw)
                .iter()
                .map(|part| {
                    let (a, b) = part.split_once('-').unwrap_or((part, part));
                    match (a.trim().parse::<u32>(), b.trim().parse::<u32>()) {
                        (Ok(a), Ok(b)) if a <= b => Ok([a, b]),
                        _ => Err(()),
                    }
                })
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
            match (kind, n.trim().parse::<u64>()) {
                ("every" | "last", Ok(n)) if n >= 1 => Ok(json!({"kind": kind, "n": n})),
                _ => Err(expected()),
            }
        }
        "tags" => {
            let mut tags = serde_json::Map::new();
            for pair in list(raw) {
                let (k, v) = pair
                    .split_once('=')
                    .ok_or_else(|| "comma-separated key=value pairs".to_owned())?;
                if k.trim().is_empty() {
                    return Err("comma-separated key=value pairs with non-empty keys".to_owned());
                }
                tags.insert(k.trim().to_owned(), json!(v.trim()));
            }
            Ok(Value::Object(tags))
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
    fn unset_means_off_with_documented_defaults() {
        let r = resolve(|_| None).unwrap();
        assert_eq!(r["SHADOWTRACE"], json!(false));
        assert_eq!(r["SHADOWTRACE_LAYERS"], json!("all"));
        assert_eq!(r["SHADOWTRACE_MODE"], json!(["local"]));
        assert_eq!(r["SHADOWTRACE_TOKENS"], json!({"kind": "all"}));
        assert_eq!(r["SHADOWTRACE_QUEUE_CAPACITY"], json!(4096));
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
        assert!(resolve(with(&[("SHADOWTRACE_QUEUE_CAPACITY", "0")])).is_err());
        assert!(resolve(with(&[("SHADOWTRACE", "maybe")])).is_err());
    }
}
