//! Declares the cfgs that aya-build sets, so the compiler knows them.
fn main() {
    println!(
        "cargo::rustc-check-cfg=cfg(bpf_target_arch, values(\"x86_64\", \"aarch64\", \"arm\", \"riscv64\", \"powerpc64\", \"s390x\", \"mips\", \"loongarch64\"))"
    );
}
