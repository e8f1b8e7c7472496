//! `heapprofd report`: reading profiles back and turning them into tables,
//! flamegraphs, the legacy text format, timelines, leak suspects and an HTML page.

pub mod model;
