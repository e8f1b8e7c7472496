//! A gzip'd pprof read one top-level protobuf field at a time, inflated as it is read:
//! what lets the push look at a profile of 100k stacks (about 25 MiB inflated, several
//! times that decoded) while holding one sample.

use std::io::{self, BufRead, BufReader, Read};

use flate2::read::GzDecoder;

use super::profile_error::ProfileError;

/// Protobuf's wire types.
pub const VARINT: u64 = 0;
/// Length-delimited: a message, string, bytes or packed field.
pub const LEN: u64 = 2;

/// The fields of a gzip'd pprof, in order.
pub struct Fields<'a> {
    input: BufReader<GzDecoder<&'a [u8]>>,
}

impl<'a> Fields<'a> {
    /// The fields of `pprof_gz`.
    pub fn new(pprof_gz: &'a [u8]) -> Self {
        Fields {
            input: BufReader::new(GzDecoder::new(pprof_gz)),
        }
    }

    /// The next field's number and wire type; `None` at the end of the profile.
    pub fn next_key(&mut self) -> Result<Option<(u64, u64)>, ProfileError> {
        Ok(varint(&mut self.input)?.map(|key| (key >> 3, key & 7)))
    }

    /// A varint field's value.
    pub fn varint(&mut self) -> Result<u64, ProfileError> {
        varint(&mut self.input)?.ok_or(ProfileError::Malformed("it ends inside a field"))
    }

    /// A length-delimited field's bytes, into `buffer`.
    pub fn bytes(&mut self, buffer: &mut Vec<u8>) -> Result<(), ProfileError> {
        let length = self.varint()?;
        buffer.clear();
        let read = (&mut self.input)
            .take(length)
            .read_to_end(buffer)
            .map_err(ProfileError::Gzip)?;
        if read as u64 != length {
            return Err(ProfileError::Malformed("it ends inside a field"));
        }
        Ok(())
    }

    /// Skips a field's value of `wire_type`.
    pub fn skip(&mut self, wire_type: u64) -> Result<(), ProfileError> {
        let length = match wire_type {
            VARINT => return self.varint().map(drop),
            1 => 8,
            LEN => self.varint()?,
            5 => 4,
            _ => return Err(ProfileError::Malformed("a field of an unknown wire type")),
        };
        let skipped = io::copy(&mut (&mut self.input).take(length), &mut io::sink())
            .map_err(ProfileError::Gzip)?;
        if skipped != length {
            return Err(ProfileError::Malformed("it ends inside a field"));
        }
        Ok(())
    }
}

/// The next varint, `None` at the end of the input before its first byte.
fn varint<R: BufRead>(input: &mut R) -> Result<Option<u64>, ProfileError> {
    let mut value = 0u64;
    for shift in (0..64).step_by(7) {
        let mut byte = [0u8];
        match input.read(&mut byte).map_err(ProfileError::Gzip)? {
            0 if shift == 0 => return Ok(None),
            0 => return Err(ProfileError::Malformed("it ends inside a varint")),
            _ => {}
        }
        value |= u64::from(byte[0] & 0x7f) << shift;
        if byte[0] & 0x80 == 0 {
            return Ok(Some(value));
        }
    }
    Err(ProfileError::Malformed("a varint of more than 10 bytes"))
}

/// Protobuf's int64 from its varint (two's complement).
pub fn as_i64(value: u64) -> i64 {
    i64::from_ne_bytes(value.to_ne_bytes())
}

impl Fields<'_> {
    /// Appends the field whose key was just read, value and all, to `out` as
    /// protobuf: the fields kept of a profile decode as a profile of those fields.
    pub fn copy(
        &mut self,
        (field, wire_type): (u64, u64),
        buffer: &mut Vec<u8>,
        out: &mut Vec<u8>,
    ) -> Result<(), ProfileError> {
        prost::encoding::encode_varint((field << 3) | wire_type, out);
        match wire_type {
            VARINT => prost::encoding::encode_varint(self.varint()?, out),
            LEN => {
                self.bytes(buffer)?;
                prost::encoding::encode_varint(buffer.len() as u64, out);
                out.extend_from_slice(buffer);
            }
            1 | 5 => {
                let mut fixed = [0u8; 8];
                let size = if wire_type == 1 { 8 } else { 4 };
                self.input
                    .read_exact(&mut fixed[..size])
                    .map_err(ProfileError::Gzip)?;
                out.extend_from_slice(&fixed[..size]);
            }
            _ => return Err(ProfileError::Malformed("a field of an unknown wire type")),
        }
        Ok(())
    }
}
