//! The page's tests: its sections, its peak, its escaping, its flamegraphs.

use super::*;
use crate::{memstats::ProcessMemory, report::session::tests::session};

#[test]
fn kernel_profiles_get_cache_and_order_tables() {
    let profile = crate::report::test_profiles::kernel_profile(&[
        (
            &["kmem_cache_alloc", "getname_flags"],
            Some("names_cache"),
            [4, 16384, 1, 4096, 400, 100],
        ),
        (
            &["kmalloc", "alloc_pipe_info"],
            Some("kmalloc-192"),
            [10, 1920, 10, 1920, 1600, 1600],
        ),
    ]);
    let mut html = String::new();
    kernel_sections(&mut html, &profile, ProcessFilter::All);
    assert!(html.contains("<h2>Slab caches</h2>"), "{html}");
    // In-use bytes first: names_cache (4 KiB) before kmalloc-192 (1.9 KiB).
    let names = html.find(">names_cache<").expect("a names_cache row");
    let kmalloc = html.find(">kmalloc-192<").expect("a kmalloc-192 row");
    assert!(names < kmalloc, "{html}");
    assert!(
        html.contains("<td>97.6</td>"),
        "names_cache's waste: {html}"
    );
    // No page samples, no order table; a user profile gets neither.
    assert!(!html.contains("Page orders"), "{html}");
    let mut user = String::new();
    kernel_sections(
        &mut user,
        &crate::report::test_profiles::abc_profile(),
        ProcessFilter::All,
    );
    assert!(user.is_empty(), "{user}");
}

#[test]
fn evenly_spaced_flamegraphs() {
    assert!((0..10).all(|i| embedded(i, 10)));
    let chosen = (0..100).filter(|&i| embedded(i, 100)).count();
    assert_eq!(chosen, MAX_FLAMEGRAPHS);
    assert!(embedded(0, 100));
}

#[test]
fn the_peak_is_the_exact_one_when_recorded() {
    let mut s = session(&["a"], &[vec![100, 300, 200, 250]]);
    assert_eq!(
        peak(&s, Some(1)),
        Some(Peak {
            value: 300.0,
            seconds: 1.0,
            after: None,
            exact: false
        })
    );
    for (i, recorded) in [120, 400, 400, 400].into_iter().enumerate() {
        s.snapshots[i].processes.get_mut(&1).expect("pid 1").memory = Some(ProcessMemory {
            pid: 1,
            peak_inuse: Some(recorded),
            ..ProcessMemory::default()
        });
    }
    assert_eq!(
        peak(&s, Some(1)),
        Some(Peak {
            value: 400.0,
            seconds: 1.0,
            after: Some(0.0),
            exact: true
        })
    );
}

#[test]
fn a_profile_that_lost_blocks_is_stated_first_and_its_peak_is_not_exact() {
    let mut s = session(&["a"], &[vec![100, 300]]);
    let exact = Peak {
        value: 300.0,
        seconds: 1.0,
        after: Some(0.0),
        exact: true,
    };
    let mut clean = String::new();
    losses_section(&mut clean, &s);
    peak_section(&mut clean, &s, Some(&exact));
    assert!(!clean.contains("Lost data"), "{clean}");
    assert!(clean.contains("exact count"), "{clean}");

    let full = heapprof_common::DropReason::LiveTableFull.describe();
    s.last.comments.push(format!("dropped: {full} = 1800000"));
    let mut lossy = String::new();
    losses_section(&mut lossy, &s);
    peak_section(&mut lossy, &s, Some(&exact));
    assert!(lossy.contains("<h2>Lost data</h2>"), "{lossy}");
    assert!(
        lossy.contains("lost: 1800000 events: live-block table full"),
        "{lossy}"
    );
    assert!(lossy.contains("raise --max-live-blocks"), "{lossy}");
    assert!(!lossy.contains("exact count"), "{lossy}");
    assert!(lossy.contains("too low"), "{lossy}");
}

#[test]
fn the_page_escapes_names_and_fetches_nothing() {
    let s = session(
        &[
            "operator new in f<std::map<int, int>> <- main",
            "malloc in <script>alert(1)</script>",
        ],
        &[vec![0, 4096, 8192, 12288], vec![10, 10, 10, 10]],
    );
    let flames = [Flame {
        label: "a<b>".into(),
        url: "data:image/svg+xml;base64,AAAA".into(),
        height: 100,
    }];
    let html = render(&s, 20, ProcessFilter::All, &flames).expect("page");
    assert!(!html.contains("<script>alert"), "unescaped name");
    assert!(html.contains("f&lt;std::map&lt;int, int&gt;&gt;"));
    assert!(html.contains("a&lt;b&gt;"));
    assert!(html.contains("no RSS recorded"));
    assert!(html.contains("id=\"suspects\""), "the leak is a suspect");
    for fetch in ["src=\"http", "href=", "url(", "@import"] {
        assert!(!html.contains(fetch), "{fetch} in the page");
    }
}

#[test]
fn kernel_sessions_chart_the_slab_instead_of_rss() {
    let mut s = session(&["kmalloc in f"], &[vec![100, 200]]);
    for snapshot in &mut s.snapshots {
        snapshot.kernel_memory = Some(crate::memstats::KernelMemory {
            slab: 1 << 20,
            slab_unreclaimable: 1 << 19,
        });
    }
    let html = render(&s, 20, ProcessFilter::All, &[]).expect("page");
    assert!(html.contains("Slab beside the traced kernel heap"));
    assert!(html.contains("SUnreclaim"));
    assert!(!html.contains("no RSS recorded"));
}

#[test]
fn flamegraph_frames_save_their_zoom_quietly() {
    let svg = "<svg height=\"342\" width=\"1200\"><script>function init(evt) {}\nhistory.replaceState(null, null, x);</script></svg>";
    let framed = framed(svg);
    assert!(framed.contains("heapprofdReplaceState(null, null, x)"));
    assert!(framed.contains("try { history.replaceState(state"));
    assert_eq!(svg_height(&framed), Some(342));
}
