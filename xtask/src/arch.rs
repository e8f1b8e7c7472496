//! The CPU architectures heapprofd is built for, and their names in Rust targets,
//! Debian packages and ELF headers (shared by setup, the static builds and the VM test).

/// A CPU architecture heapprofd is built for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Arch {
    /// 64-bit Arm (Rock 5B and other arm64 boards).
    Aarch64,
    /// 64-bit x86.
    #[value(name = "x86_64")]
    X86_64,
}

impl Arch {
    /// The Rust target of the static build.
    pub fn musl_target(self) -> &'static str {
        match self {
            Arch::Aarch64 => "aarch64-unknown-linux-musl",
            Arch::X86_64 => "x86_64-unknown-linux-musl",
        }
    }

    /// The Rust target of a build against glibc (Debian's C library).
    pub fn gnu_target(self) -> &'static str {
        match self {
            Arch::Aarch64 => "aarch64-unknown-linux-gnu",
            Arch::X86_64 => "x86_64-unknown-linux-gnu",
        }
    }

    /// The architecture of the machine xtask runs on (the one it was built for).
    pub fn host() -> Arch {
        if cfg!(target_arch = "aarch64") {
            Arch::Aarch64
        } else {
            Arch::X86_64
        }
    }

    /// Debian's name of this architecture (`dpkg --print-architecture`).
    pub fn debian_arch(self) -> &'static str {
        match self {
            Arch::Aarch64 => "arm64",
            Arch::X86_64 => "amd64",
        }
    }

    /// Debian's cross C compiler for this architecture and the C library headers it
    /// compiles with (the preload library includes `<stdint.h>`). On a host of this
    /// architecture the compiler's name is only provided by the native `gcc`.
    pub fn cross_c_packages(self) -> [&'static str; 2] {
        match self {
            Arch::Aarch64 => ["gcc-aarch64-linux-gnu", "libc6-dev-arm64-cross"],
            Arch::X86_64 => ["gcc-x86-64-linux-gnu", "libc6-dev-amd64-cross"],
        }
    }

    /// The C compiler for this architecture by its multiarch name: Debian's cross gcc,
    /// or on a host of this architecture the native one (which provides that name).
    pub fn gcc(self) -> &'static str {
        match self {
            Arch::Aarch64 => "aarch64-linux-gnu-gcc",
            Arch::X86_64 => "x86_64-linux-gnu-gcc",
        }
    }

    /// Debian's cross C++ compiler for this architecture (provided by the native `g++`
    /// on a host of this architecture).
    pub fn cross_cxx_package(self) -> &'static str {
        match self {
            Arch::Aarch64 => "g++-aarch64-linux-gnu",
            Arch::X86_64 => "g++-x86-64-linux-gnu",
        }
    }

    /// ELF `e_machine` of this architecture.
    pub fn elf_machine(self) -> u16 {
        match self {
            Arch::Aarch64 => 183,
            Arch::X86_64 => 62,
        }
    }
}
