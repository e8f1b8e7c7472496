//! The seeded random numbers of the property and damage tests, in a module of its own
//! so tests of any part of the daemon can draw them without importing another test.

/// xorshift64*: small, seedable, good enough to explore inputs.
pub(crate) struct Rng(pub(crate) u64);

impl Rng {
    /// The next number of the sequence.
    pub(crate) fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    /// A number in `0..n` (0 when `n` is 0).
    pub(crate) fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }

    /// One of `items`, which must not be empty.
    pub(crate) fn pick<'a>(&mut self, items: &[&'a str]) -> &'a str {
        items[self.below(items.len() as u64) as usize]
    }
}
