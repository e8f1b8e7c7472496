//! arm64: fixed-width words decoded by hand, for the instructions the kernel simulates
//! and the common integer, load/store and system instructions that may come before.

use super::{Arch, MAX_SKIPPED_INSTRUCTIONS, Needs, Placement, Tracked, Value, ValueRegisters};

/// Instructions the arm64 kernel simulates rather than single-steps
/// (arch/arm64/kernel/probes/decode-insn.c): PC-relative branches, adr/adrp and
/// literal loads. Anything newer kernels added is left out: unsure means entry.
pub(super) fn simulated(word: u32) -> Option<&'static str> {
    if word & 0xff00_0010 == 0x5400_0000 {
        Some("b.cond")
    } else if word & 0x7e00_0000 == 0x3400_0000 {
        Some("cbz/cbnz")
    } else if word & 0x7e00_0000 == 0x3600_0000 {
        Some("tbz/tbnz")
    } else if word & 0x7c00_0000 == 0x1400_0000 {
        Some("b/bl")
    } else if word & 0x1f00_0000 == 0x1000_0000 {
        Some("adr/adrp")
    } else {
        None
    }
}

/// The stack pointer in [`Effect`]'s register numbers.
const SP: u8 = 32;
/// The link register (return address).
const LR: u8 = 30;

/// What an instruction that falls through does to the registers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Effect {
    /// Writes no general-purpose register (flags, memory, hints).
    Nothing,
    /// Writes these registers: x0-x30 as 0-30, the stack pointer as [`SP`].
    Writes([Option<u8>; 3]),
    /// `mov xd, xm`: a 64-bit copy.
    Move { to: u8, from: u8 },
    /// `mul xd, xn, xm`: the low 64 bits of a product.
    Multiply { to: u8, left: u8, right: u8 },
    /// The stack pointer goes down by `bytes` (a prologue's `stp x29, x30, [sp,
    /// #-N]!` or `sub sp, sp, #N`), possibly storing registers: writes nothing else.
    Push { bytes: u32 },
}

fn field(word: u32, shift: u32) -> u8 {
    ((word >> shift) & 0x1f) as u8
}

/// Register `number` of an instruction where 31 names the zero register: no write.
fn zr(number: u8) -> Option<u8> {
    (number != 31).then_some(number)
}

/// Register `number` of an instruction where 31 names the stack pointer.
fn sp(number: u8) -> Option<u8> {
    Some(if number == 31 { SP } else { number })
}

/// The effect of the common integer, load/store and system instructions (ARMv8-A
/// encodings); `None` for any other, which ends the search.
///
/// Each instruction class is decoded on its own: each answers `None` only for the
/// words outside the encodings it knows, so the next class is tried.
fn effect(word: u32) -> Option<Effect> {
    data_processing_immediate(word)
        .or_else(|| data_processing_register(word))
        .or_else(|| load_store(word))
        .or_else(|| system(word))
}

/// An instruction that writes these registers (`None`s for fewer than three).
fn writes(a: Option<u8>, b: Option<u8>, c: Option<u8>) -> Option<Effect> {
    Some(Effect::Writes([a, b, c]))
}

/// Whether an add/sub sets the flags (adds, subs, cmp, cmn): its rd 31 is then the
/// zero register rather than the stack pointer.
fn sets_flags(word: u32) -> bool {
    word & 0x2000_0000 != 0
}

/// Data processing, immediate: add/sub, logical, move wide, bitfield, extract.
fn data_processing_immediate(word: u32) -> Option<Effect> {
    let rd = field(word, 0);
    if word & 0x1f00_0000 == 0x1100_0000 {
        // sub sp, sp, #imm{, lsl #12} (64-bit, no flags): a push.
        if word & 0xff80_03ff == 0xd100_03ff {
            let shift = if word & 0x0040_0000 != 0 { 12 } else { 0 };
            return Some(Effect::Push {
                bytes: ((word >> 10) & 0xfff) << shift,
            });
        }
        // add/sub (immediate): rd 31 is sp unless flags are set (cmp, cmn).
        return writes(if sets_flags(word) { zr(rd) } else { sp(rd) }, None, None);
    }
    if word & 0x1f80_0000 == 0x1200_0000 {
        // Logical (immediate): and/orr/eor into sp, ands (tst) into xzr.
        let ands = word & 0x6000_0000 == 0x6000_0000;
        return writes(if ands { zr(rd) } else { sp(rd) }, None, None);
    }
    if matches!(word & 0x1f80_0000, 0x1280_0000 | 0x1300_0000 | 0x1380_0000) {
        // Move wide, bitfield (shifts, extends), extract.
        return writes(zr(rd), None, None);
    }
    None
}

/// Data processing, register: logical (with `mov`), add/sub, conditional, one, two
/// and three sources (with `mul`).
fn data_processing_register(word: u32) -> Option<Effect> {
    let rd = field(word, 0);
    if word & 0x1f00_0000 == 0x0a00_0000 {
        // Logical (shifted register); orr xd, xzr, xm is `mov xd, xm`.
        let mov64 = word & 0xffe0_ffe0 == 0xaa00_03e0;
        if mov64 && rd != 31 {
            return Some(Effect::Move {
                to: rd,
                from: field(word, 16),
            });
        }
        return writes(zr(rd), None, None);
    }
    if word & 0x1f20_0000 == 0x0b00_0000 {
        return writes(zr(rd), None, None); // add/sub (shifted register)
    }
    if word & 0x1f20_0000 == 0x0b20_0000 {
        // add/sub (extended register): rd 31 is sp unless flags are set.
        return writes(if sets_flags(word) { zr(rd) } else { sp(rd) }, None, None);
    }
    if word & 0x1fe0_0000 == 0x1a40_0000 {
        return Some(Effect::Nothing); // ccmp/ccmn: flags only
    }
    if matches!(word & 0x1fe0_0000, 0x1a00_0000 | 0x1a80_0000)
        || word & 0x5fe0_0000 == 0x1ac0_0000
        || word & 0x5fe0_0000 == 0x5ac0_0000
    {
        // adc/sbc, csel family, data processing with one or two sources.
        return writes(zr(rd), None, None);
    }
    if word & 0x1f00_0000 == 0x1b00_0000 {
        // Three sources: madd (mul when the addend is xzr), umulh...
        let madd64 = word & 0xffe0_8000 == 0x9b00_0000;
        if madd64 && field(word, 10) == 31 && rd != 31 {
            return Some(Effect::Multiply {
                to: rd,
                left: field(word, 5),
                right: field(word, 16),
            });
        }
        return writes(zr(rd), None, None);
    }
    None
}

/// Loads and stores of general-purpose registers (V = 0): single registers at the
/// offsets and indexings, and pairs (with the prologue's push).
fn load_store(word: u32) -> Option<Effect> {
    let rd = field(word, 0);
    let rn = field(word, 5);
    let load = word & 0x0040_0000 != 0;
    if word & 0x3f00_0000 == 0x3900_0000 {
        // Register, unsigned offset: no write back. PRFM loads nothing.
        let prefetch = word & 0xffc0_0000 == 0xf980_0000;
        return writes(if load && !prefetch { zr(rd) } else { None }, None, None);
    }
    if word & 0x3f20_0000 == 0x3800_0000 {
        // Register, unscaled/unprivileged offset, or pre/post-indexed (write back).
        let write_back = word & 0x0400 != 0;
        return writes(
            if load { zr(rd) } else { None },
            write_back.then(|| sp(rn)).flatten(),
            None,
        );
    }
    if word & 0x3f20_0c00 == 0x3820_0800 {
        return writes(if load { zr(rd) } else { None }, None, None); // register offset
    }
    if word & 0x3e00_0000 == 0x2800_0000 {
        // stp xt, xt2, [sp, #-N]! (64-bit, pre-index, a negative offset): a push.
        if word & 0xffc0_03e0 == 0xa980_03e0 {
            let imm7 = (word >> 15) & 0x7f;
            if imm7 & 0x40 != 0 {
                return Some(Effect::Push {
                    bytes: (0x80 - imm7) * 8,
                });
            }
        }
        // Pair: bits 24-23 01 post-index, 11 pre-index (write back).
        let write_back = word & 0x0080_0000 != 0;
        let (rt, rt2) = if load {
            (zr(rd), zr(field(word, 10)))
        } else {
            (None, None)
        };
        return writes(rt, rt2, write_back.then(|| sp(rn)).flatten());
    }
    None
}

/// System: `mrs` and the hints (with the pointer-authentication ones on lr).
fn system(word: u32) -> Option<Effect> {
    if word & 0xfff0_0000 == 0xd530_0000 {
        return writes(zr(field(word, 0)), None, None); // mrs
    }
    if word & 0xffff_f01f == 0xd503_201f {
        // Hints: nop, bti...; the pointer-authentication ones sign or check lr.
        let lr_hint = matches!(word, 0xd503_233f | 0xd503_237f | 0xd503_23bf | 0xd503_23ff);
        return writes(lr_hint.then_some(LR), None, None);
    }
    None
}

/// x0-x30's values, followed through instructions that fall through, and how the
/// stack pointer and the link register changed.
#[derive(Clone)]
struct Registers {
    values: Tracked,
    /// Bytes pushed: the stack pointer is this far below its value at the entry.
    pushed: u32,
    /// Whether the link register was written (signed by `paciasp`): a return probe
    /// would replace it where it no longer holds the plain return address.
    lr_written: bool,
}

impl Registers {
    fn at_entry() -> Registers {
        Registers {
            values: Tracked::at_entry(Arch::Aarch64, 31),
            pushed: 0,
            lr_written: false,
        }
    }

    /// Applies `effect`; false if it writes the stack pointer other than by a push.
    fn apply(&mut self, effect: Effect) -> bool {
        match effect {
            Effect::Nothing => {}
            Effect::Push { bytes } => {
                let Some(pushed) = self.pushed.checked_add(bytes) else {
                    return false;
                };
                self.pushed = pushed;
            }
            Effect::Move { to, from } => {
                let value = if from == 31 {
                    Value::Unknown
                } else {
                    self.values.get(from)
                };
                self.values.set(to, value);
            }
            Effect::Multiply { to, left, right } => {
                let value = self.values.get(left).times(self.values.get(right));
                self.values.set(to, value);
            }
            Effect::Writes(registers) => {
                for register in registers.into_iter().flatten() {
                    if register == SP {
                        return false;
                    }
                    if register == LR {
                        self.lr_written = true;
                    }
                    self.values.set(register, Value::Unknown);
                }
            }
        }
        true
    }
}

/// The target of a direct branch at `pc`, if the word is one.
fn branch_target(word: u32, pc: i64) -> Option<i64> {
    let sign_extend = |value: u32, bits: u32| -> i64 {
        let shift = 64 - bits;
        ((i64::from(value)) << shift) >> shift
    };
    if word & 0x7c00_0000 == 0x1400_0000 {
        Some(pc + 4 * sign_extend(word & 0x03ff_ffff, 26))
    } else if word & 0xff00_0010 == 0x5400_0000 || word & 0x7e00_0000 == 0x3400_0000 {
        // b.cond, cbz/cbnz: imm19 at bit 5.
        Some(pc + 4 * sign_extend((word >> 5) & 0x7ffff, 19))
    } else if word & 0x7e00_0000 == 0x3600_0000 {
        // tbz/tbnz: imm14 at bit 5.
        Some(pc + 4 * sign_extend((word >> 5) & 0x3fff, 14))
    } else {
        None
    }
}

/// br/braa/eret...: register-indirect jumps (blr returns past itself, ret leaves).
fn indirect_jump(word: u32) -> bool {
    word & 0xfe60_0000 == 0xd600_0000
}

pub(super) fn place(code: &[u8], needs: Needs, return_probe: bool) -> Placement {
    let entry = |reason: &str| Placement::entry(Arch::Aarch64, code, needs, reason);
    let words: Vec<u32> = code
        .as_chunks::<4>()
        .0
        .iter()
        .map(|c| u32::from_le_bytes(*c))
        .collect();
    let skipped = match Skipped::follow(&words) {
        Ok(skipped) => skipped,
        Err(why) => return entry(why),
    };
    let (offset, what) = (skipped.offset, skipped.what);
    if offset == 0 {
        return entry(&format!("entry: the first instruction is a {what}"));
    }
    let registers = &skipped.registers;
    let Some(located) = registers.values.locate(needs) else {
        return entry(
            "entry: a value the probe reads is overwritten before the first simulated instruction",
        );
    };
    if let Some(why) = jump_into_skipped(&words, &skipped, needs, located) {
        return entry(why);
    }
    // Past a push, or where the return address is signed, a return probe at the spot
    // would replace a return address the function no longer returns through: the
    // return probes go on the exits, where it is back in the link register.
    let exits = if return_probe && (registers.pushed != 0 || registers.lr_written) {
        match exits(&words) {
            Ok(exits) => exits,
            Err(why) => return entry(&format!("entry: {why}")),
        }
    } else {
        Vec::new()
    };
    Placement {
        sp_adjust: registers.pushed,
        exits,
        ..Placement::moved(Arch::Aarch64, offset, what, needs, located)
    }
}

/// The instructions before the first simulated one, which the probe skips.
struct Skipped {
    /// The registers at the simulated instruction.
    registers: Registers,
    /// The registers before each skipped instruction, for the branches back into them.
    before: Vec<Registers>,
    /// Where the simulated instruction is, in bytes from the function's start.
    offset: u64,
    /// What it is.
    what: &'static str,
}

impl Skipped {
    /// Follows the registers from the entry to the first simulated instruction among
    /// the first ones; why the probe stays at the entry if that fails.
    fn follow(words: &[u32]) -> Result<Skipped, &'static str> {
        let mut registers = Registers::at_entry();
        let mut before = Vec::new();
        for (index, &word) in words.iter().enumerate().take(MAX_SKIPPED_INSTRUCTIONS + 1) {
            if let Some(what) = simulated(word) {
                return Ok(Skipped {
                    registers,
                    before,
                    offset: index as u64 * 4,
                    what,
                });
            }
            before.push(registers.clone());
            let Some(effect) = effect(word) else {
                return Err(
                    "entry: an instruction before the first simulated one is not understood",
                );
            };
            if !registers.apply(effect) {
                return Err(
                    "entry: an instruction before the first simulated one writes the stack pointer",
                );
            }
        }
        Err("entry: no simulated instruction near the start")
    }
}

/// Why a jump in the function keeps the probe at the entry, if one does: an indirect
/// jump (it could land anywhere), or a branch into the skipped instructions that does
/// not reach the spot as the entry did.
fn jump_into_skipped(
    words: &[u32],
    skipped: &Skipped,
    needs: Needs,
    located: ValueRegisters,
) -> Option<&'static str> {
    let offset = skipped.offset;
    for (index, &word) in words.iter().enumerate() {
        if indirect_jump(word) {
            return Some("entry: the function has an indirect jump");
        }
        if let Some(target) = branch_target(word, index as i64 * 4)
            && target > 0
            && target <= offset as i64
            && !loops_back_alike(
                words,
                &skipped.before,
                target as usize / 4,
                offset as usize / 4,
                needs,
                located,
            )
        {
            return Some("entry: a branch in the function lands in the skipped instructions");
        }
    }
    None
}

/// Whether a branch back to instruction `target` of the skipped ones (before the spot,
/// instruction `spot`) reaches the spot as the entry did: the probe then fires again
/// (mimalloc's `operator new` retries after its new-handler), which the programs take
/// for a call forwarding its arguments, as long as the values are where the entry's
/// path put them and the stack pointer is where it was. After a branch from anywhere,
/// only a callee-saved register (x19-x28) that no instruction past the skipped ones
/// writes (but on the way out: an epilogue restores them) still holds the value the
/// entry's path gave it; the others are unknown.
fn loops_back_alike(
    words: &[u32],
    before: &[Registers],
    target: usize,
    spot: usize,
    needs: Needs,
    located: ValueRegisters,
) -> bool {
    let Some(at_target) = before.get(target) else {
        return false;
    };
    let mut kept: [bool; 31] = core::array::from_fn(|register| (19..=28).contains(&register));
    let leaving = exit_blocks(words);
    for (index, &word) in words.iter().enumerate().skip(spot) {
        if leaving.contains(&index) {
            continue;
        }
        // Branches write nothing but bl's link register; calls (bl, blr) keep x19-x28.
        let blr = word & 0xffff_fc1f == 0xd63f_0000;
        if simulated(word).is_some() || blr {
            continue;
        }
        match effect(word) {
            None => return false,
            Some(Effect::Nothing) => {}
            Some(Effect::Push { .. }) => return false,
            Some(Effect::Move { to, .. } | Effect::Multiply { to, .. }) => {
                if let Some(slot) = kept.get_mut(usize::from(to)) {
                    *slot = false;
                }
            }
            Some(Effect::Writes(registers)) => {
                for register in registers.into_iter().flatten() {
                    if let Some(slot) = kept.get_mut(usize::from(register)) {
                        *slot = false;
                    }
                }
            }
        }
    }
    let mut looped = at_target.clone();
    for register in 0..31u8 {
        if !kept[usize::from(register)] {
            looped.values.set(register, Value::Unknown);
        }
    }
    for &word in &words[target..spot] {
        match effect(word) {
            Some(Effect::Push { .. }) | None => return false,
            Some(effect) => {
                if !looped.apply(effect) {
                    return false;
                }
            }
        }
    }
    looped.values.locate(needs) == Some(located)
}

/// The instructions of the blocks that leave the function (by `ret`, or by a branch
/// out of it): from each of those back to its block's start, a branch or a branch
/// target.
fn exit_blocks(words: &[u32]) -> std::collections::HashSet<usize> {
    let len = words.len() as i64 * 4;
    let targets: std::collections::HashSet<i64> = words
        .iter()
        .enumerate()
        .filter_map(|(index, &word)| branch_target(word, index as i64 * 4))
        .collect();
    let mut leaving = std::collections::HashSet::new();
    for (index, &word) in words.iter().enumerate() {
        let at = index as i64 * 4;
        let out = is_b(word) && branch_target(word, at).is_some_and(|t| !(0..len).contains(&t));
        if word != RET && !out {
            continue;
        }
        leaving.insert(index);
        for i in (0..index).rev() {
            if branch_target(words[i], i as i64 * 4).is_some()
                || words[i] == RET
                || targets.contains(&((i as i64 + 1) * 4))
            {
                break;
            }
            leaving.insert(i);
        }
    }
    leaving
}

/// `ret` (through the link register).
const RET: u32 = 0xd65f_03c0;

/// Whether `word` is an unconditional `b` (not `bl`).
fn is_b(word: u32) -> bool {
    word & 0xfc00_0000 == 0x1400_0000
}

/// Whether `word` puts the stack pointer back up: `ldp x29, x30, [sp], #N` or any
/// post-indexed load pair from it, `add sp, sp, #N`.
fn pops(word: u32) -> bool {
    let ldp_post_sp = word & 0xffc0_03e0 == 0xa8c0_03e0;
    let add_sp = word & 0xff80_03ff == 0x9100_03ff;
    ldp_post_sp || add_sp
}

/// The offsets of a function's exits, every place where it hands the return to its
/// caller with the return address back in the link register and the stack pointer at
/// its entry value: each `ret`, and each `b` out of the function (a tail call) after
/// its frame was popped in the same block. `Err` says why they cannot all be known.
fn exits(words: &[u32]) -> Result<Vec<u64>, &'static str> {
    let len = words.len() as i64 * 4;
    let mut targets = std::collections::HashSet::new();
    for (index, &word) in words.iter().enumerate() {
        if let Some(target) = branch_target(word, index as i64 * 4) {
            targets.insert(target);
        }
    }
    let mut exits = Vec::new();
    for (index, &word) in words.iter().enumerate() {
        let at = index as i64 * 4;
        if word == RET {
            exits.push(at as u64);
            continue;
        }
        if word & 0xfffffc1f == 0xd65f_0000 || matches!(word, 0xd65f_0bff | 0xd65f_0fff) {
            return Err(
                "the function returns through another register or authenticates its return",
            );
        }
        let call = word & 0xfc00_0000 == 0x9400_0000;
        let Some(target) = branch_target(word, at).filter(|_| !call) else {
            continue;
        };
        if (0..len).contains(&target) {
            continue;
        }
        if !is_b(word) {
            return Err("a conditional branch leaves the function");
        }
        // The frame must be popped in this block: back from the branch to the block's
        // start (a branch or a branch target), a pop.
        let popped = (0..index)
            .rev()
            .take_while(|&i| {
                branch_target(words[i], i as i64 * 4).is_none()
                    && words[i] != RET
                    && !targets.contains(&((i as i64 + 1) * 4))
            })
            .any(|i| pops(words[i]));
        if !popped {
            return Err("a branch leaves the function before its frame is popped");
        }
        exits.push(at as u64);
    }
    if exits.is_empty() {
        return Err("the function has no exit");
    }
    Ok(exits)
}
