//! Listing counters through the embedded API over the local catalog: pages in name
//! order, prefixes, cursors, deleted counters gone, and typed errors for bad input.

use tally_engine::{Increment, ListError, Tally, TallyConfig, TallyError, LIST_PAGE_COUNTERS_MAX};

#[tokio::test]
async fn pages_walk_every_counter_in_name_order() -> Result<(), TallyError> {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let tally = Tally::open(dir.path(), TallyConfig::default()).await?;
    for i in 0..25 {
        tally.incr(&format!("likes:{i:02}"), Increment::new(1)).await?;
    }
    tally.incr("views:1", Increment::new(1)).await?;
    tally.incr("likes", Increment::new(1)).await?;

    let mut got = Vec::new();
    let mut after: Option<String> = None;
    loop {
        let page = tally.list_counters("likes:", after.as_deref(), 10)?;
        assert!(page.counters.len() <= 10);
        got.extend(page.counters);
        match page.next {
            Some(next) => after = Some(next),
            None => break,
        }
    }
    let want: Vec<String> = (0..25).map(|i| format!("likes:{i:02}")).collect();
    assert_eq!(got, want);

    // Exactly one page's worth: no cursor to an empty page.
    let page = tally.list_counters("likes:", Some("likes:14"), 10)?;
    assert_eq!(page.counters.first().map(String::as_str), Some("likes:15"));
    assert_eq!(page.next, None);

    let all = tally.list_counters("", None, LIST_PAGE_COUNTERS_MAX)?;
    assert_eq!(all.counters.len(), 27);
    assert_eq!(all.counters[0], "likes");
    assert_eq!(all.counters.last().map(String::as_str), Some("views:1"));

    tally.delete_counter("likes:03").await?;
    let page = tally.list_counters("likes:0", None, 100)?;
    assert!(!page.counters.contains(&"likes:03".to_string()), "{page:?}");

    assert!(matches!(
        tally.list_counters("", None, 0),
        Err(TallyError::InvalidListing(ListError::Limit { .. }))
    ));
    assert!(matches!(
        tally.list_counters("", None, LIST_PAGE_COUNTERS_MAX + 1),
        Err(TallyError::InvalidListing(ListError::Limit { .. }))
    ));
    assert!(matches!(
        tally.list_counters("a b", None, 1),
        Err(TallyError::InvalidListing(ListError::Prefix { .. }))
    ));
    assert!(matches!(
        tally.list_counters("", Some(""), 1),
        Err(TallyError::InvalidListing(ListError::Cursor))
    ));
    assert!(tally.list_counters("", None, 1)?.next.is_some());
    tally.shutdown().await
}
