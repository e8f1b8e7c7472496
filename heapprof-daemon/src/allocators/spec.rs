//! Custom allocators named on the command line (`--allocator SPEC`).
//!
//! A spec is whitespace-separated items `ROLE=FUNCTION(FIELD,...)`:
//! - `ROLE` is `alloc` (returns a new block), `free` (releases one) or `realloc` (moves
//!   one to a new block, like C's `realloc`);
//! - `FIELD`s say where things are, arguments counted from 1: `size=argN` or `size=N`
//!   (a constant, for fixed-size pools), `count=argN` (multiplies the size), `ptr=argN`
//!   (the block freed, or moved), `ret` (the new block is the return value) or
//!   `out=argN` (it is stored through that pointer argument, and the call returns 0 on
//!   success, as `posix_memalign`).
//!
//! For example `alloc=pool_alloc(size=arg2,ret) free=pool_free(ptr=arg2)`. `@FILE`
//! reads items from a file, any number per line, `#` starting a comment.

use std::path::Path;

use heapprof_common::ProbeRole;

use super::api::{Signature, Size};

/// Most argument registers the probes read (x86-64 passes six in registers).
const MAX_ARG: u8 = 6;

/// A function named with `--allocator`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CustomFunction {
    /// Its symbol.
    pub name: String,
    /// What it does.
    pub signature: Signature,
}

/// Why a spec was refused.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum SpecError {
    /// An item did not parse, or its fields do not fit its role.
    #[error(
        "invalid --allocator item `{item}`: {reason} (expected ROLE=FUNCTION(FIELDS), e.g. alloc=pool_alloc(size=arg2,ret) free=pool_free(ptr=arg2))"
    )]
    Item {
        /// The item as written.
        item: String,
        /// What is wrong with it.
        reason: String,
    },
    /// A function named twice.
    #[error("--allocator names {0} twice; give each function once")]
    Duplicate(String),
    /// `@FILE` could not be read.
    #[error("cannot read the --allocator file {path}: {reason}")]
    File {
        /// The file.
        path: String,
        /// The I/O error.
        reason: String,
    },
    /// Nothing was given.
    #[error("--allocator got an empty spec; give items such as alloc=pool_alloc(size=arg2,ret)")]
    Empty,
}

/// Parses every `--allocator` value (specs or `@FILE`s) into functions.
pub fn parse_all(values: &[String]) -> Result<Vec<CustomFunction>, SpecError> {
    let mut functions: Vec<CustomFunction> = Vec::new();
    for value in values {
        let text = match value.strip_prefix('@') {
            Some(path) => read_file(Path::new(path))?,
            None => value.clone(),
        };
        let parsed = parse(&text)?;
        if parsed.is_empty() {
            return Err(SpecError::Empty);
        }
        for function in parsed {
            if functions.iter().any(|f| f.name == function.name) {
                return Err(SpecError::Duplicate(function.name));
            }
            functions.push(function);
        }
    }
    Ok(functions)
}

fn read_file(path: &Path) -> Result<String, SpecError> {
    let text = std::fs::read_to_string(path).map_err(|err| SpecError::File {
        path: path.display().to_string(),
        reason: err.to_string(),
    })?;
    Ok(text
        .lines()
        .map(|line| line.split_once('#').map_or(line, |(code, _)| code))
        .collect::<Vec<_>>()
        .join("\n"))
}

/// Parses one spec's items.
pub fn parse(text: &str) -> Result<Vec<CustomFunction>, SpecError> {
    items(text)?.iter().map(|item| parse_item(item)).collect()
}

/// Splits on whitespace outside parentheses, so `f(size=arg1, ret)` stays one item.
fn items(text: &str) -> Result<Vec<String>, SpecError> {
    let mut items = Vec::new();
    let mut current = String::new();
    let mut depth = 0u32;
    for c in text.chars() {
        match c {
            '(' => depth += 1,
            ')' => depth = depth.saturating_sub(1),
            _ => {}
        }
        if c.is_whitespace() && depth == 0 {
            if !current.is_empty() {
                items.push(std::mem::take(&mut current));
            }
        } else if !c.is_whitespace() {
            current.push(c);
        }
    }
    if !current.is_empty() {
        if depth > 0 {
            return Err(SpecError::Item {
                item: current,
                reason: "unclosed parenthesis".into(),
            });
        }
        items.push(current);
    }
    Ok(items)
}

/// Parses one item, `ROLE=FUNCTION(FIELDS)`, checking its fields fit its role.
fn parse_item(item: &str) -> Result<CustomFunction, SpecError> {
    let (role, rest) = split_role(item)?;
    let (name, fields) = split_function(item, rest)?;
    let signature = Fields::parse(item, fields)?.signature(item, role)?;
    Ok(CustomFunction {
        name: name.to_owned(),
        signature,
    })
}

/// The refusal of `item`, for `reason`.
fn item_error(item: &str, reason: &str) -> SpecError {
    SpecError::Item {
        item: item.to_owned(),
        reason: reason.to_owned(),
    }
}

/// Splits `ROLE=` off `item`: its role, and the rest (`FUNCTION(FIELDS)`).
fn split_role(item: &str) -> Result<(ProbeRole, &str), SpecError> {
    let fail = |reason: &str| item_error(item, reason);
    let before_fields = item.split('(').next().unwrap_or(item);
    let (role, _) = before_fields
        .split_once('=')
        .ok_or_else(|| fail("no ROLE= (alloc, free or realloc)"))?;
    let rest = &item[role.len() + 1..];
    let role = match role {
        "alloc" => ProbeRole::Alloc,
        "free" => ProbeRole::Free,
        "realloc" => ProbeRole::Realloc,
        _ => return Err(fail("the role must be alloc, free or realloc")),
    };
    Ok((role, rest))
}

/// Splits `FUNCTION(FIELDS)` (`rest` of `item`) into the function's name, checked to
/// be a symbol, and the fields between the parentheses.
fn split_function<'a>(item: &str, rest: &'a str) -> Result<(&'a str, &'a str), SpecError> {
    let fail = |reason: &str| item_error(item, reason);
    let (name, fields) = rest
        .strip_suffix(')')
        .and_then(|rest| rest.split_once('('))
        .ok_or_else(|| fail("no (FIELDS) after the function's name"))?;
    let valid_name = !name.is_empty()
        && !name.starts_with(|c: char| c.is_ascii_digit())
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '$'));
    if !valid_name {
        return Err(fail("the function's name is not a symbol"));
    }
    Ok((name, fields))
}

/// An item's fields as written, each at most once, before they are checked against
/// its role.
#[derive(Default)]
struct Fields {
    size: Option<Size>,
    count: Option<u8>,
    ptr: Option<u8>,
    out: Option<u8>,
    ret: bool,
}

impl Fields {
    /// Reads the comma-separated `fields` of `item`, refusing unknown or repeated ones.
    fn parse(item: &str, fields: &str) -> Result<Self, SpecError> {
        let fail = |reason: &str| item_error(item, reason);
        let mut parsed = Self::default();
        for field in fields.split(',').filter(|f| !f.is_empty()) {
            let (key, value) = field.split_once('=').unwrap_or((field, ""));
            let arg = || argument(item, key, value);
            let seen = match key {
                "size" => {
                    let size = match value.parse::<u64>() {
                        Ok(bytes) => Size::Fixed(bytes),
                        Err(_) => Size::Arg(arg().map_err(|_| {
                            fail(&format!(
                                "size= takes arg1 to arg{MAX_ARG} or a number of bytes"
                            ))
                        })?),
                    };
                    parsed.size.replace(size).is_some()
                }
                "count" => parsed.count.replace(arg()?).is_some(),
                "ptr" => parsed.ptr.replace(arg()?).is_some(),
                "out" => parsed.out.replace(arg()?).is_some(),
                "ret" if value.is_empty() => std::mem::replace(&mut parsed.ret, true),
                _ => return Err(fail(&format!("unknown field `{field}`"))),
            };
            if seen {
                return Err(fail(&format!("{key} given twice")));
            }
        }
        Ok(parsed)
    }

    /// The signature of a function of `role` with these fields, or why they do not fit
    /// it (in `item`).
    fn signature(self, item: &str, role: ProbeRole) -> Result<Signature, SpecError> {
        let fail = |reason: &str| item_error(item, reason);
        let Self {
            size,
            count,
            ptr,
            out,
            ret,
        } = self;
        if role == ProbeRole::Free {
            if size.is_some() || count.is_some() || out.is_some() || ret {
                return Err(fail("free takes only ptr=argN"));
            }
            return Ok(Signature::free(
                ptr.ok_or_else(|| fail("free needs ptr=argN"))?,
            ));
        }
        let size = size.ok_or_else(|| fail("a size=argN or size=BYTES is needed"))?;
        if role == ProbeRole::Realloc && ptr.is_none() {
            return Err(fail("realloc needs ptr=argN, the block moved"));
        }
        if role == ProbeRole::Alloc && ptr.is_some() {
            return Err(fail(
                "alloc takes no ptr= (use out=argN for an out-pointer)",
            ));
        }
        match (ret, out) {
            (true, None) => {}
            (false, Some(_)) if role == ProbeRole::Alloc => {}
            (true, Some(_)) => return Err(fail("give either ret or out=argN, not both")),
            _ => {
                return Err(fail(if role == ProbeRole::Alloc {
                    "say where the new block is: ret or out=argN"
                } else {
                    "realloc needs ret (the new block is the return value)"
                }));
            }
        }
        Ok(Signature {
            role,
            size,
            count,
            ptr,
            out,
            round_to_pages: false,
        })
    }
}

/// The argument register `value` names (`argN`, counted from 1) for field `key` of
/// `item`, as a 0-based index.
fn argument(item: &str, key: &str, value: &str) -> Result<u8, SpecError> {
    value
        .strip_prefix("arg")
        .and_then(|n| n.parse::<u8>().ok())
        .filter(|n| (1..=MAX_ARG).contains(n))
        .map(|n| n - 1)
        .ok_or_else(|| item_error(item, &format!("{key}= takes arg1 to arg{MAX_ARG}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_pool_example() {
        let functions =
            parse("alloc=pool_alloc(size=arg2,ret) free=pool_free(ptr=arg2)").expect("valid spec");
        assert_eq!(
            functions,
            vec![
                CustomFunction {
                    name: "pool_alloc".into(),
                    signature: Signature::alloc(1),
                },
                CustomFunction {
                    name: "pool_free".into(),
                    signature: Signature::free(1),
                },
            ]
        );
    }

    #[test]
    fn parses_every_field_and_spaces_inside_parentheses() {
        let functions = parse(
            "alloc=obj_get(size=64, ret)\n realloc=arena_resize(ptr=arg2, count=arg3, size=arg4, ret)  alloc=get_block(out=arg1,size=arg3)",
        )
        .expect("valid spec");
        assert_eq!(functions[0].signature.size, Size::Fixed(64));
        assert_eq!(functions[1].signature, Signature::realloc_n(1, 2, 3));
        assert_eq!(functions[2].signature, Signature::alloc_out(0, 2));
    }

    #[test]
    fn refuses_bad_items_with_the_reason() {
        let cases = [
            ("pool_alloc(size=arg1,ret)", "no ROLE="),
            ("grab=pool_alloc(size=arg1,ret)", "alloc, free or realloc"),
            ("alloc=pool_alloc", "no (FIELDS)"),
            ("alloc=pool_alloc(size=arg1)", "ret or out=argN"),
            ("alloc=pool_alloc(size=arg9,ret)", "arg1 to arg6"),
            ("alloc=pool_alloc(ret)", "size=argN"),
            ("free=pool_free(size=arg1)", "only ptr"),
            ("free=pool_free()", "needs ptr"),
            ("realloc=pool_realloc(size=arg2,ret)", "needs ptr"),
            ("alloc=pool_alloc(size=arg1,ret,ret)", "twice"),
            ("alloc=pool alloc(size=arg1,ret)", "no (FIELDS)"),
            ("alloc=9pool(size=arg1,ret)", "not a symbol"),
            ("alloc=pool_alloc(size=arg1,ret", "unclosed"),
            ("alloc=pool_alloc(colour=red,ret)", "unknown field"),
        ];
        for (spec, reason) in cases {
            let err = parse(spec).expect_err(spec).to_string();
            assert!(err.contains(reason), "{spec}: {err}");
            assert!(err.contains("--allocator"), "{spec}: {err}");
        }
    }

    #[test]
    fn reads_files_with_comments_and_refuses_duplicates() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("pools.spec");
        std::fs::write(
            &path,
            "# the pool\nalloc=pool_alloc(size=arg2,ret) # carve\nfree=pool_free(ptr=arg2)\n",
        )
        .expect("write");
        let functions = parse_all(&[format!("@{}", path.display())]).expect("file parses");
        assert_eq!(functions.len(), 2);
        let err = parse_all(&[
            format!("@{}", path.display()),
            "free=pool_free(ptr=arg1)".into(),
        ])
        .expect_err("pool_free twice");
        assert_eq!(err, SpecError::Duplicate("pool_free".into()));
        let missing = parse_all(&["@/nonexistent/spec".into()]).expect_err("no file");
        assert!(missing.to_string().contains("/nonexistent/spec"));
        assert_eq!(parse_all(&["  ".into()]), Err(SpecError::Empty));
    }
}
