//! Parser of tracefs event `format` files: the record layout of a tracepoint.
//!
//! ```text
//! (tabs shown as spaces)
//! name: kmalloc
//! ID: 658
//! format:
//!     field:unsigned short common_type;    offset:0;    size:2;    signed:0;
//!     ...
//!     field:const void * ptr;    offset:16;    size:8;    signed:0;
//!
//! print fmt: "call_site=%pS ptr=%p ...", ...
//! ```
//! The file is outside input (a kernel of any version, or a vendor's), so every
//! line of the field section is checked and anything unexpected is an error
//! naming the line.

use thiserror::Error;

/// A tracepoint's record layout.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EventFormat {
    /// The event's name (`kmalloc`).
    pub name: String,
    /// The event's id, when the file gives one.
    pub id: Option<u32>,
    /// The fields, common ones included, in file order.
    pub fields: Vec<Field>,
}

/// One field of a record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Field {
    /// The field's name (`ptr`).
    pub name: String,
    /// The C declaration without the name (`const void *`).
    pub type_name: String,
    /// Byte offset in the record.
    pub offset: u32,
    /// Size in bytes.
    pub size: u32,
    /// Whether the C type is signed.
    pub signed: bool,
}

/// Why a format file could not be parsed.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum FormatError {
    /// A line of the file is not what the format allows.
    #[error("line {line}: {problem}")]
    Malformed {
        /// 1-based line number.
        line: usize,
        /// What is wrong with it.
        problem: String,
    },
    /// The file has no `name:` line.
    #[error("no `name:` line")]
    MissingName,
    /// The file has no `format:` section or no field in it.
    #[error("no fields (a `format:` section with `field:` lines is required)")]
    NoFields,
}

impl EventFormat {
    /// The field named `name`.
    pub fn field(&self, name: &str) -> Option<&Field> {
        self.fields.iter().find(|f| f.name == name)
    }
}

/// Parses the text of a format file.
pub fn parse(text: &str) -> Result<EventFormat, FormatError> {
    let mut name = None;
    let mut id = None;
    let mut fields = Vec::new();
    let mut in_format = false;
    for (index, raw) in text.lines().enumerate() {
        let line = index + 1;
        let trimmed = raw.trim();
        let malformed = |problem: String| FormatError::Malformed { line, problem };
        if let Some(value) = raw.strip_prefix("name:") {
            let value = value.trim();
            if value.is_empty() || !value.chars().all(is_identifier_char) {
                return Err(malformed(format!("invalid event name `{value}`")));
            }
            name = Some(value.to_owned());
        } else if let Some(value) = raw.strip_prefix("ID:") {
            id = Some(
                value
                    .trim()
                    .parse()
                    .map_err(|_| malformed(format!("invalid ID `{}`", value.trim())))?,
            );
        } else if raw.starts_with("format:") {
            in_format = true;
        } else if raw.starts_with("print fmt:") {
            in_format = false;
        } else if in_format && trimmed.starts_with("field:") {
            fields.push(parse_field(trimmed).map_err(malformed)?);
        } else if in_format && !trimmed.is_empty() {
            return Err(malformed(format!(
                "unexpected text in the field list: `{trimmed}`"
            )));
        }
    }
    let name = name.ok_or(FormatError::MissingName)?;
    if fields.is_empty() {
        return Err(FormatError::NoFields);
    }
    Ok(EventFormat { name, id, fields })
}

fn is_identifier_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_'
}

/// `field:const void * ptr; offset:16; size:8; signed:0;`
fn parse_field(line: &str) -> Result<Field, String> {
    let mut declaration = None;
    let mut offset = None;
    let mut size = None;
    let mut signed = None;
    for part in line.split(';').map(str::trim).filter(|p| !p.is_empty()) {
        let (key, value) = part
            .split_once(':')
            .ok_or_else(|| format!("`{part}` is not `key:value`"))?;
        let number = || -> Result<u32, String> {
            value
                .trim()
                .parse()
                .map_err(|_| format!("{key} `{}` is not a number", value.trim()))
        };
        match key.trim() {
            "field" => declaration = Some(value.trim()),
            "offset" => offset = Some(number()?),
            "size" => size = Some(number()?),
            "signed" => signed = Some(number()? != 0),
            // Newer kernels may add attributes; they do not change the layout.
            _ => {}
        }
    }
    let declaration = declaration.ok_or("no `field:` declaration")?;
    let (type_name, name) = split_declaration(declaration)
        .ok_or_else(|| format!("cannot find the field name in `{declaration}`"))?;
    Ok(Field {
        name,
        type_name,
        offset: offset.ok_or_else(|| format!("field `{declaration}` has no offset"))?,
        size: size.ok_or_else(|| format!("field `{declaration}` has no size"))?,
        signed: signed.unwrap_or(false),
    })
}

/// Splits `const void * ptr` into (`const void *`, `ptr`); array suffixes
/// (`char comm[16]`) are dropped from the name.
fn split_declaration(declaration: &str) -> Option<(String, String)> {
    // `char comm[16]`: the array suffix follows the name. (`__data_loc char[] name`
    // ends in the name, so it keeps its brackets as part of the type.)
    let without_array = match declaration.find('[') {
        Some(bracket) if declaration.ends_with(']') => declaration[..bracket].trim_end(),
        _ => declaration,
    };
    let name_start = without_array
        .rfind(|c: char| !is_identifier_char(c))
        .map_or(0, |i| i + 1);
    let name = &without_array[name_start..];
    let type_name = without_array[..name_start].trim();
    if name.is_empty() || type_name.is_empty() || name.starts_with(|c: char| c.is_ascii_digit()) {
        return None;
    }
    Some((type_name.to_owned(), name.to_owned()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_fields_with_pointers_arrays_and_data_loc() {
        let text = "name: demo\nID: 12\nformat:\n\
            \tfield:unsigned short common_type;\toffset:0;\tsize:2;\tsigned:0;\n\
            \n\
            \tfield:const void * ptr;\toffset:16;\tsize:8;\tsigned:0;\n\
            \tfield:char parent_comm[16];\toffset:24;\tsize:16;\tsigned:0;\n\
            \tfield:__data_loc char[] name;\toffset:40;\tsize:4;\tsigned:0;\n\
            \tfield:int node;\toffset:44;\tsize:4;\tsigned:1;\n\
            \n\
            print fmt: \"ptr=%p\", REC->ptr\n";
        let format = parse(text).expect("valid");
        assert_eq!(format.name, "demo");
        assert_eq!(format.id, Some(12));
        let names: Vec<&str> = format.fields.iter().map(|f| f.name.as_str()).collect();
        assert_eq!(names, ["common_type", "ptr", "parent_comm", "name", "node"]);
        let ptr = format.field("ptr").expect("ptr");
        assert_eq!(
            (ptr.offset, ptr.size, ptr.type_name.as_str()),
            (16, 8, "const void *")
        );
        assert_eq!(
            format.field("name").map(|f| f.type_name.as_str()),
            Some("__data_loc char[]")
        );
        assert!(format.field("node").expect("node").signed);
    }

    #[test]
    fn rejects_malformed_files_naming_the_line() {
        let bad_offset = "name: x\nformat:\n\tfield:int a;\toffset:four;\tsize:4;\tsigned:1;\n";
        assert_eq!(
            parse(bad_offset),
            Err(FormatError::Malformed {
                line: 3,
                problem: "offset `four` is not a number".into()
            })
        );
        let no_size = "name: x\nformat:\n\tfield:int a;\toffset:4;\tsigned:1;\n";
        assert!(matches!(
            parse(no_size),
            Err(FormatError::Malformed { line: 3, .. })
        ));
        let no_name = "format:\n\tfield:int a;\toffset:4;\tsize:4;\tsigned:1;\n";
        assert_eq!(parse(no_name), Err(FormatError::MissingName));
        assert_eq!(parse("name: x\nID: 3\n"), Err(FormatError::NoFields));
        let garbage = "name: x\nformat:\n\tthis is not a field\n";
        assert!(matches!(
            parse(garbage),
            Err(FormatError::Malformed { line: 3, .. })
        ));
        let nameless = "name: x\nformat:\n\tfield:int;\toffset:4;\tsize:4;\tsigned:1;\n";
        assert!(matches!(
            parse(nameless),
            Err(FormatError::Malformed { line: 3, .. })
        ));
        assert!(parse("name: a b\nformat:\n").is_err());
        assert!(parse("").is_err());
    }
}
