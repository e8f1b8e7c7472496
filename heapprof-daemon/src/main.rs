//! heapprofd
static BPF_OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/heapprof"));
fn main() { println!("{}", BPF_OBJECT.len()); }
