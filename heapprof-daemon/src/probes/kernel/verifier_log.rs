//! The verifier's reason for refusing a program, found in its log.

/// The line of a verifier log that says why it refused a program: the first line
/// after the last instruction it walked that is not a register state, a source line
/// or the closing statistics. Lines before the walk (checks of the program's own
/// BTF, `reg type unsupported for arg#0`) are often harmless and only count when the
/// walk gave no reason. `None` when the log holds no such line.
pub fn verifier_reason(log: &str) -> Option<&str> {
    let lines: Vec<&str> = log.lines().map(str::trim).collect();
    let walked = lines.iter().rposition(|line| is_instruction(line));
    let after = walked.map_or(0, |last| last + 1);
    lines[after..]
        .iter()
        .chain(&lines[..after])
        .copied()
        .find(|line| !is_trace(line))
}

/// `12: (79) r1 = *(u64 *)(r1 +8)`: an instruction the verifier walked.
fn is_instruction(line: &str) -> bool {
    line.split_once(": (")
        .is_some_and(|(index, _)| !index.is_empty() && index.bytes().all(|b| b.is_ascii_digit()))
}

/// Whether a verifier log line is its trace (instructions, states, source lines,
/// statistics) rather than a message.
fn is_trace(line: &str) -> bool {
    const PREFIXES: [&str; 16] = [
        ";",
        "from ",
        "func#",
        "Func#",
        "Validating ",
        "last_idx ",
        "regs=",
        "parent ",
        "mark_precise",
        "caller:",
        "callee:",
        "returning from callee",
        "to caller at",
        "propagating",
        "processed ",
        "verification time",
    ];
    // `12: ...`: an instruction or the states at one.
    let numbered = line
        .split_once(':')
        .is_some_and(|(head, _)| !head.is_empty() && head.bytes().all(|b| b.is_ascii_digit()));
    // `R1_w=scalar()`, `frame1: R1=...`.
    let state = line.starts_with('R')
        && line.contains('=')
        && line[1..]
            .split(['=', '_'])
            .next()
            .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()));
    line.is_empty()
        || numbered
        || state
        || line.starts_with("frame")
        || line.starts_with("stack depth")
        // `func 'f' arg0 has btf_id 102 type STRUCT 'callback_head'`: an access allowed.
        || (line.starts_with("func '") && line.contains(" has btf_id "))
        || PREFIXES.iter().any(|prefix| line.starts_with(prefix))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_verifiers_reason_is_found_in_its_log() {
        // Linux 6.1 (Debian's 6.1.0-50-amd64) refusing a direct context read of
        // kvfree_call_rcu's callback: the harmless check of the program's own BTF
        // comes first, the reason after the instruction.
        let log = "reg type unsupported for arg#0 function rcu_free#85\n\
                   0: R1=ctx(off=0,imm=0) R10=fp0\n\
                   ; T::from_register(unsafe { *ptr as u64 })\n\
                   0: (79) r2 = *(u64 *)(r1 +8)\n\
                   func 'kvfree_call_rcu' arg1 type FUNC_PROTO is not a struct\n\
                   invalid bpf_context access off=8 size=8\n\
                   verification time 377 usec\n\
                   stack depth 0+0\n\
                   processed 1 insns (limit 1000000) max_states_per_insn 0 total_states 0 \
                   peak_states 0 mark_read 0\n";
        assert_eq!(
            verifier_reason(log),
            Some("func 'kvfree_call_rcu' arg1 type FUNC_PROTO is not a struct")
        );
        // 6.12: an access the verifier allowed, then the refused one.
        let log = "0: R1=ctx() R10=fp0\n\
                   0: (79) r2 = *(u64 *)(r1 +8)          ; R1=ctx() R2_w=scalar()\n\
                   1: (79) r3 = *(u64 *)(r1 +0)\n\
                   func 'kvfree_call_rcu' arg0 has btf_id 102 type STRUCT 'callback_head'\n\
                   2: R1=ctx() R3_w=ptr_callback_head()\n\
                   3: (1f) r1 -= r2\n\
                   math between ptr_ pointer and register with unbounded min value is not allowed\n\
                   verification time 1492 usec\n";
        assert_eq!(
            verifier_reason(log),
            Some("math between ptr_ pointer and register with unbounded min value is not allowed")
        );
        // A helper the kernel lacks, after branch states.
        let log = "func#0 @0\nfunc#1 @40\n0: R1=ctx(id=0,off=0,imm=0) R10=fp0\n\
                   from 3 to 5: R0_w=inv0 R10=fp0\n5: (85) call unknown#181\n\
                   invalid func unknown#181\nprocessed 9 insns\n";
        assert_eq!(verifier_reason(log), Some("invalid func unknown#181"));
        // Refused before any instruction was walked.
        assert_eq!(
            verifier_reason("arg#0 type is not a struct\nR1 type=ctx expected=fp\n"),
            Some("arg#0 type is not a struct")
        );
        assert_eq!(
            verifier_reason("0: R1=ctx() R10=fp0\nprocessed 1 insns\n"),
            None
        );
        assert_eq!(verifier_reason(""), None);
    }
}
