//! A BPF array map created with `BPF_F_MMAPABLE`, mapped whole into the daemon's
//! memory: its values are read and changed in place, with no system call per value.
//!
//! The kernel maps every page of the array at once, and they count in the daemon's
//! resident memory: a large array (the live-block table, tens of MiB) is mapped only
//! while it is scanned ([`ArrayHandle`]), a small one for good.

use std::{
    marker::PhantomData,
    os::fd::{AsFd as _, AsRawFd as _, BorrowedFd, OwnedFd},
    ptr::NonNull,
    sync::atomic::{AtomicU32, AtomicU64},
};

use anyhow::{Context as _, Result, bail};
use aya::{
    Ebpf,
    maps::{Map, MapData},
};

/// A mapped BPF array of `T` (plain data whose size is a multiple of 8, so that the
/// kernel lays the values out as a `[T]`). The mapping keeps the map alive.
pub(crate) struct MappedArray<T> {
    base: NonNull<T>,
    len: usize,
    bytes: usize,
    _values: PhantomData<T>,
}

// SAFETY: the mapping is shared memory that the kernel's programs change with atomic
// instructions; the daemon reads it with volatile or atomic accesses only.
unsafe impl<T> Send for MappedArray<T> {}

impl<T: Copy> MappedArray<T> {
    /// Maps the array `name` of a loaded object (which keeps it: several parts of the
    /// daemon may map one array).
    pub(crate) fn map(ebpf: &Ebpf, name: &str) -> Result<Self> {
        let map = array(ebpf, name)?;
        let len = checked_len::<T>(map, name)?;
        Self::of(map.fd().as_fd(), len, name)
    }

    /// Maps the `len` values of the array at `fd`, named `name`.
    fn of(fd: BorrowedFd<'_>, len: usize, name: &str) -> Result<Self> {
        let page = crate::sys::page_size() as usize;
        let bytes = (len * size_of::<T>()).next_multiple_of(page).max(page);
        // SAFETY: a shared mapping of the whole array, which the kernel allows for
        // BPF_F_MMAPABLE arrays; unmapped once, on drop.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                bytes,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                0,
            )
        };
        if base == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error())
                .with_context(|| format!("mapping BPF map {name} into memory"));
        }
        let base = NonNull::new(base.cast::<T>()).context("mmap returned a null mapping")?;
        Ok(Self {
            base,
            len,
            bytes,
            _values: PhantomData,
        })
    }

    /// Values in the array.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// A copy of value `index` as it is now (the programs may change it meanwhile).
    pub(crate) fn read(&self, index: usize) -> Option<T> {
        (index < self.len).then(|| {
            // SAFETY: inside the mapping; T is plain data, read whole.
            unsafe { self.base.as_ptr().add(index).read_volatile() }
        })
    }

    /// The place of a `U` at byte offset `offset` of value `index`, if it lies inside
    /// the value and is aligned for `U` (values are 8-byte multiples at a page-aligned
    /// base, so an offset aligned within the value is aligned in memory).
    fn place<U>(&self, index: usize, offset: usize) -> Option<*mut U> {
        if index >= self.len
            || !offset.is_multiple_of(align_of::<U>())
            || offset + size_of::<U>() > size_of::<T>()
            || align_of::<U>() > 8
        {
            return None;
        }
        // SAFETY: inside the mapping, as checked above.
        Some(unsafe {
            self.base
                .as_ptr()
                .add(index)
                .cast::<u8>()
                .add(offset)
                .cast()
        })
    }

    /// The 64-bit word at byte offset `offset` of value `index`, for atomic access.
    pub(crate) fn word(&self, index: usize, offset: usize) -> Option<&AtomicU64> {
        // SAFETY: an aligned word inside the mapping, valid while self is; the kernel
        // side changes it with atomic instructions too.
        self.place(index, offset)
            .map(|place| unsafe { AtomicU64::from_ptr(place) })
    }

    /// The 32-bit word at byte offset `offset` of value `index`, for atomic access.
    pub(crate) fn word32(&self, index: usize, offset: usize) -> Option<&AtomicU32> {
        // SAFETY: as in `word`.
        self.place(index, offset)
            .map(|place| unsafe { AtomicU32::from_ptr(place) })
    }

    /// A copy of the `U` (plain data) at byte offset `offset` of value `index`, as it
    /// is now: part of a value, without copying the rest.
    pub(crate) fn read_at<U: Copy>(&self, index: usize, offset: usize) -> Option<U> {
        // SAFETY: an aligned `U` inside the mapping; plain data, read whole.
        self.place::<U>(index, offset)
            .map(|place| unsafe { place.read_volatile() })
    }
}

/// The array `name` of a loaded object.
fn array<'a>(ebpf: &'a Ebpf, name: &str) -> Result<&'a MapData> {
    match ebpf.map(name) {
        Some(Map::Array(map)) => Ok(map),
        Some(_) => bail!("BPF map {name} is not an array"),
        None => bail!("BPF map {name} missing from the object"),
    }
}

/// The values in `map`, an array of `T` named `name`, once its layout is checked.
fn checked_len<T>(map: &MapData, name: &str) -> Result<usize> {
    let info = map
        .info()
        .with_context(|| format!("reading BPF map {name}"))?;
    if info.value_size() as usize != size_of::<T>() || !size_of::<T>().is_multiple_of(8) {
        bail!("BPF map {name} has values of {} bytes", info.value_size());
    }
    Ok(info.max_entries() as usize)
}

/// A mappable BPF array, mapped on demand.
pub(crate) struct ArrayHandle<T> {
    fd: OwnedFd,
    len: usize,
    name: &'static str,
    _values: PhantomData<T>,
}

impl<T: Copy> ArrayHandle<T> {
    /// The array `name` of a loaded object (which keeps it).
    pub(crate) fn of(ebpf: &Ebpf, name: &'static str) -> Result<Self> {
        let map = array(ebpf, name)?;
        let len = checked_len::<T>(map, name)?;
        let fd = map
            .fd()
            .as_fd()
            .try_clone_to_owned()
            .with_context(|| format!("duplicating the descriptor of BPF map {name}"))?;
        Ok(Self {
            fd,
            len,
            name,
            _values: PhantomData,
        })
    }

    /// The array, mapped until the mapping is dropped.
    pub(crate) fn map(&self) -> Result<MappedArray<T>> {
        MappedArray::of(self.fd.as_fd(), self.len, self.name)
    }
}

impl<T> Drop for MappedArray<T> {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `take`, unmapped once.
        unsafe { libc::munmap(self.base.as_ptr().cast(), self.bytes) };
    }
}
