//! A process's environment as its program got it at exec (`/proc/PID/environ`), read
//! once and asked several questions (its `LD_PRELOAD`, the system preload's opt-out).

/// The environment block of one process: `NAME=value` entries separated by NUL bytes.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Environ(Vec<u8>);

impl Environ {
    /// Process `pid`'s environment, or `None` when it cannot be read (the process has
    /// gone, or it is not ours to read).
    pub fn of(pid: u32) -> Option<Self> {
        std::fs::read(format!("/proc/{pid}/environ")).ok().map(Self)
    }

    /// An environment from its raw block (tests, and callers that read it elsewhere).
    pub fn from_block(block: impl Into<Vec<u8>>) -> Self {
        Self(block.into())
    }

    /// The values of every entry named `name`, in order (a block may repeat a name).
    pub fn values<'a>(&'a self, name: &'a str) -> impl Iterator<Item = &'a [u8]> + 'a {
        self.0.split(|b| *b == 0).filter_map(move |entry| {
            entry
                .strip_prefix(name.as_bytes())
                .and_then(|rest| rest.strip_prefix(b"="))
        })
    }

    /// Whether some entry is exactly `name=value`.
    pub fn has(&self, name: &str, value: &str) -> bool {
        self.values(name).any(|v| v == value.as_bytes())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_are_found_by_their_exact_name() {
        let environ =
            Environ::from_block(&b"PATH=/bin\0XLD_PRELOAD=x\0LD_PRELOAD=a b\0LD_PRELOAD\0"[..]);
        let values: Vec<&[u8]> = environ.values("LD_PRELOAD").collect();
        assert_eq!(values, [&b"a b"[..]]);
        assert!(environ.has("PATH", "/bin"));
        assert!(!environ.has("PATH", "/bi"));
        assert!(!Environ::default().has("PATH", ""));
    }

    #[test]
    fn this_process_is_readable() {
        let environ = Environ::of(std::process::id()).expect("own environ");
        if let Ok(path) = std::env::var("PATH") {
            assert!(environ.has("PATH", &path));
        }
    }
}
