//! Uprobe session links (`BPF_TRACE_UPROBE_SESSION`, Linux 6.13+) for sampled sessions.
//!
//! A session link runs one program at a probed function's entry and, unless the entry
//! returned nonzero, at its return: the entry program decides per call whether the
//! return probe is needed. Sampled sessions attach each object's functions this way, so
//! an allocation that is not sampled costs one trap instead of two (see
//! `heapprof-ebpf`'s `entry_session` and the `calls` module).
//!
//! aya 0.16 loads multi-uprobe programs with `BPF_TRACE_UPROBE_MULTI` only and cannot
//! create session links, so this module loads [`names::PROG_ENTRY_SESSION`] itself:
//! it parses the same object with aya-obj, points its map references at the maps aya
//! created (so both share every table), and calls `BPF_PROG_LOAD` with the session's
//! expected attach type, then `BPF_LINK_CREATE` per object. A kernel without session
//! links refuses one or the other, and the errno says so: the caller then falls back to
//! the entry and return links of every other session, once, and says so.

use std::{
    collections::HashMap,
    ffi::{CString, c_void},
    io,
    os::fd::{AsFd as _, AsRawFd as _, FromRawFd as _, OwnedFd},
    path::Path,
    sync::Mutex,
};

use aya::{
    Ebpf,
    maps::{Map, MapData},
};
use aya_obj::{Object, generated::bpf_insn};
use heapprof_common::names;

/// `BPF_PROG_LOAD` (uapi `enum bpf_cmd`).
const BPF_PROG_LOAD: libc::c_long = 5;
/// `BPF_LINK_CREATE`.
const BPF_LINK_CREATE: libc::c_long = 28;
/// `BPF_PROG_TYPE_KPROBE` (uapi `enum bpf_prog_type`): uprobe programs are of this type.
const BPF_PROG_TYPE_KPROBE: u32 = 2;
/// `BPF_TRACE_UPROBE_SESSION` (uapi `enum bpf_attach_type`, Linux 6.13+).
const BPF_TRACE_UPROBE_SESSION: u32 = 57;
/// Bytes of verifier log kept when a load fails.
const LOG_SIZE: usize = 1 << 20;

/// The head of `union bpf_attr` for `BPF_PROG_LOAD`, up to the BTF records (the kernel
/// takes the fields after them as zero).
#[repr(C)]
#[derive(Default)]
struct ProgLoadAttr {
    prog_type: u32,
    insn_cnt: u32,
    insns: u64,
    license: u64,
    log_level: u32,
    log_size: u32,
    log_buf: u64,
    kern_version: u32,
    prog_flags: u32,
    prog_name: [u8; 16],
    prog_ifindex: u32,
    expected_attach_type: u32,
    prog_btf_fd: u32,
    func_info_rec_size: u32,
    func_info: u64,
    func_info_cnt: u32,
    line_info_rec_size: u32,
    line_info: u64,
    line_info_cnt: u32,
    attach_btf_id: u32,
}

/// `union bpf_attr` for `BPF_LINK_CREATE` of a uprobe-multi or session link.
#[repr(C)]
#[derive(Default)]
struct LinkCreateAttr {
    prog_fd: u32,
    target_fd: u32,
    attach_type: u32,
    flags: u32,
    path: u64,
    offsets: u64,
    ref_ctr_offsets: u64,
    cookies: u64,
    cnt: u32,
    uprobe_flags: u32,
    pid: u32,
    _pad: u32,
}

/// `bpf(cmd, attr)`, returning the new descriptor.
fn bpf<T>(cmd: libc::c_long, attr: &mut T) -> io::Result<OwnedFd> {
    // SAFETY: `attr` is a live, initialised `bpf_attr` prefix of the size passed.
    let ret = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            cmd,
            std::ptr::from_mut(attr).cast::<c_void>(),
            size_of::<T>(),
        )
    };
    if ret < 0 {
        return Err(io::Error::last_os_error());
    }
    let fd = i32::try_from(ret).map_err(|_| io::Error::other("descriptor out of range"))?;
    // SAFETY: the kernel returned a new descriptor that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// The data of an aya map, whatever its kind.
fn map_data(map: &Map) -> &MapData {
    match map {
        Map::Array(m)
        | Map::ArrayOfMaps(m)
        | Map::BloomFilter(m)
        | Map::CgroupArray(m)
        | Map::CgroupStorage(m)
        | Map::CgrpStorage(m)
        | Map::CpuMap(m)
        | Map::DevMap(m)
        | Map::DevMapHash(m)
        | Map::HashMap(m)
        | Map::HashOfMaps(m)
        | Map::InodeStorage(m)
        | Map::LpmTrie(m)
        | Map::LruHashMap(m)
        | Map::PerCpuArray(m)
        | Map::PerCpuCgroupStorage(m)
        | Map::PerCpuHashMap(m)
        | Map::PerCpuLruHashMap(m)
        | Map::PerfEventArray(m)
        | Map::ProgramArray(m)
        | Map::Queue(m)
        | Map::ReusePortSockArray(m)
        | Map::RingBuf(m)
        | Map::SockHash(m)
        | Map::SockMap(m)
        | Map::SkStorage(m)
        | Map::Stack(m)
        | Map::StackTraceMap(m)
        | Map::Unsupported(m)
        | Map::XskMap(m) => m,
    }
}

/// Why the session program could not be had: the kernel's refusal (its errno, and the
/// verifier's last lines when it has some), or a fault of heapprofd's own.
#[derive(Debug)]
pub struct Refusal {
    /// The kernel's error, if it refused.
    pub errno: Option<i32>,
    /// What was refused, in words.
    pub message: String,
}

impl std::fmt::Display for Refusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

/// `BPF_BTF_LOAD`.
const BPF_BTF_LOAD: libc::c_long = 18;

/// `union bpf_attr` for `BPF_BTF_LOAD`.
#[repr(C)]
#[derive(Default)]
struct BtfLoadAttr {
    btf: u64,
    btf_log_buf: u64,
    btf_size: u32,
    btf_log_size: u32,
    btf_log_level: u32,
}

/// Program `name` of `object`, ready to load: its instructions with their map
/// references pointing at `ebpf`'s maps, its license, and its BTF (loaded into the
/// kernel) with the function and line records the verifier needs for callbacks
/// (`bpf_loop`'s).
struct Prepared {
    insns: Vec<bpf_insn>,
    license: CString,
    btf: OwnedFd,
    func_info: Vec<u8>,
    func_info_rec_size: u32,
    func_info_cnt: u32,
    line_info: Vec<u8>,
    line_info_rec_size: u32,
    line_info_cnt: u32,
}

/// Prepares program `name` of `object` (see [`Prepared`]).
fn prepare_program(object: &[u8], ebpf: &Ebpf, name: &str) -> Result<Prepared, Refusal> {
    let fault = |message: String| Refusal {
        errno: None,
        message,
    };
    let parse =
        || Object::parse(object).map_err(|err| fault(format!("parsing the BPF object: {err}")));
    // The maps as parsed (relocation borrows them while it changes a second copy).
    let parsed = parse()?;
    let mut obj = parse()?;
    // Session links exist from 6.13 on, which has every BTF kind aya would sanitize.
    let btf = obj
        .fixup_and_sanitize_btf(|| Some(|_| true))
        .map_err(|err| fault(format!("preparing the object's BTF: {err}")))?
        .ok_or_else(|| fault("the BPF object has no BTF".to_owned()))?
        .to_bytes();
    let mut attr = BtfLoadAttr {
        btf: btf.as_ptr() as u64,
        btf_size: u32::try_from(btf.len()).unwrap_or(u32::MAX),
        ..BtfLoadAttr::default()
    };
    let btf = bpf(BPF_BTF_LOAD, &mut attr).map_err(|err| Refusal {
        errno: err.raw_os_error(),
        message: format!("loading the object's BTF: {err}"),
    })?;
    let fds: HashMap<&str, i32> = ebpf
        .maps()
        .map(|(map_name, map)| (map_name, map_data(map).fd().as_fd().as_raw_fd()))
        .collect();
    let mut pairs = Vec::with_capacity(parsed.maps.len());
    for (map_name, map) in &parsed.maps {
        let fd = fds
            .get(map_name.as_str())
            .ok_or_else(|| fault(format!("BPF map {map_name} is not in the loaded object")))?;
        pairs.push((map_name.as_str(), *fd, map));
    }
    let text_sections = obj.functions.keys().map(|(section, _)| *section).collect();
    obj.relocate_maps(pairs.into_iter(), &text_sections)
        .map_err(|err| fault(format!("relocating the maps: {err}")))?;
    obj.relocate_externs()
        .map_err(|err| fault(format!("relocating externs: {err}")))?;
    obj.relocate_calls(&text_sections)
        .map_err(|err| fault(format!("relocating calls: {err}")))?;
    obj.sanitize_functions(|| true);
    let program = obj
        .programs
        .get(name)
        .ok_or_else(|| fault(format!("BPF program {name} missing from the object")))?;
    let function = obj
        .functions
        .get(&program.function_key())
        .ok_or_else(|| fault(format!("BPF program {name} has no code")))?;
    Ok(Prepared {
        insns: function.instructions.clone(),
        license: program.license.clone(),
        btf,
        func_info: function.func_info.func_info_bytes(),
        func_info_rec_size: u32::try_from(function.func_info_rec_size).unwrap_or(0),
        func_info_cnt: u32::try_from(function.func_info.len()).unwrap_or(0),
        line_info: function.line_info.line_info_bytes(),
        line_info_rec_size: u32::try_from(function.line_info_rec_size).unwrap_or(0),
        line_info_cnt: u32::try_from(function.line_info.len()).unwrap_or(0),
    })
}

/// Loads [`names::PROG_ENTRY_SESSION`] from `object` (the object `ebpf` was loaded
/// from) for session links.
fn load(object: &[u8], ebpf: &Ebpf) -> Result<OwnedFd, Refusal> {
    let name = names::PROG_ENTRY_SESSION;
    let program = prepare_program(object, ebpf, name)?;
    let mut prog_name = [0u8; 16];
    for (to, from) in prog_name.iter_mut().zip(name.bytes().take(15)) {
        *to = from;
    }
    let mut attr = ProgLoadAttr {
        prog_type: BPF_PROG_TYPE_KPROBE,
        insn_cnt: u32::try_from(program.insns.len()).unwrap_or(u32::MAX),
        insns: program.insns.as_ptr() as u64,
        license: program.license.as_ptr() as u64,
        prog_name,
        expected_attach_type: BPF_TRACE_UPROBE_SESSION,
        prog_btf_fd: program.btf.as_raw_fd() as u32,
        func_info_rec_size: program.func_info_rec_size,
        func_info: program.func_info.as_ptr() as u64,
        func_info_cnt: program.func_info_cnt,
        line_info_rec_size: program.line_info_rec_size,
        line_info: program.line_info.as_ptr() as u64,
        line_info_cnt: program.line_info_cnt,
        ..ProgLoadAttr::default()
    };
    match bpf(BPF_PROG_LOAD, &mut attr) {
        Ok(fd) => Ok(fd),
        Err(err) => {
            // Again with the verifier's log, for its words.
            let mut log = vec![0u8; LOG_SIZE];
            attr.log_level = 1;
            attr.log_size = LOG_SIZE as u32;
            attr.log_buf = log.as_mut_ptr() as u64;
            let _ = bpf(BPF_PROG_LOAD, &mut attr).map(drop);
            let end = log.iter().position(|b| *b == 0).unwrap_or(log.len());
            let text = String::from_utf8_lossy(&log[..end]);
            let mut tail: Vec<&str> = text.lines().rev().take(3).collect();
            tail.reverse();
            let detail = if tail.is_empty() {
                String::new()
            } else {
                format!(" ({})", tail.join(" / "))
            };
            Err(Refusal {
                errno: err.raw_os_error(),
                message: format!("loading {name} with the session attach type: {err}{detail}"),
            })
        }
    }
}

/// The session program [`prepare`] loaded, or why it could not.
static PREPARED: Mutex<Option<Result<OwnedFd, Refusal>>> = Mutex::new(None);

/// Loads the session program from `object` (the object `ebpf` was just loaded from),
/// for [`take_prepared`]. Called before the daemon takes any map out of `ebpf` (aya-log's
/// buffer, the probe specs), as the program's references to them are resolved here.
pub fn prepare(object: &[u8], ebpf: &Ebpf) {
    let loaded = load(object, ebpf);
    if let Ok(mut prepared) = PREPARED.lock() {
        *prepared = Some(loaded);
    }
}

/// The program [`prepare`] loaded, or the kernel's refusal; `None` if not prepared.
pub fn take_prepared() -> Option<Result<OwnedFd, Refusal>> {
    PREPARED
        .lock()
        .ok()
        .and_then(|mut prepared| prepared.take())
}

/// Attaches `program` to the functions of the object at `path` at file `offsets`, with
/// attach `cookies`, in process `pid` (0: every process), as one session link.
pub fn attach(
    program: &OwnedFd,
    path: &Path,
    offsets: &[u64],
    cookies: &[u64],
    pid: u32,
) -> io::Result<OwnedFd> {
    use std::os::unix::ffi::OsStrExt as _;
    let path = CString::new(path.as_os_str().as_bytes())
        .map_err(|err| io::Error::new(io::ErrorKind::InvalidInput, err))?;
    let mut attr = LinkCreateAttr {
        prog_fd: program.as_raw_fd() as u32,
        attach_type: BPF_TRACE_UPROBE_SESSION,
        path: path.as_ptr() as u64,
        offsets: offsets.as_ptr() as u64,
        cookies: cookies.as_ptr() as u64,
        cnt: u32::try_from(offsets.len()).unwrap_or(u32::MAX),
        pid,
        ..LinkCreateAttr::default()
    };
    bpf(BPF_LINK_CREATE, &mut attr)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn attrs_have_the_kernels_layout() {
        // uapi: expected_attach_type at offset 68, uprobe_multi.path at 16, pid at 56.
        assert_eq!(std::mem::offset_of!(ProgLoadAttr, expected_attach_type), 68);
        assert_eq!(std::mem::offset_of!(ProgLoadAttr, func_info), 80);
        assert_eq!(std::mem::offset_of!(ProgLoadAttr, line_info_cnt), 104);
        assert_eq!(std::mem::offset_of!(LinkCreateAttr, path), 16);
        assert_eq!(std::mem::offset_of!(LinkCreateAttr, cnt), 48);
        assert_eq!(std::mem::offset_of!(LinkCreateAttr, pid), 56);
    }
}
