//! Listing counters by name: one bounded page at a time, in byte order of the names,
//! so an operator (or `GET /v1/counters`) can walk millions of counters without any
//! one call scanning them all.

use crate::catalog::Catalog;
use crate::error::{ListError, TallyError};
use serde::{Deserialize, Serialize};
use tally_core::CounterName;

/// Most counters one page lists: bounds the work (and the answer) of one call.
pub const LIST_PAGE_COUNTERS_MAX: usize = 1000;
/// Longest prefix accepted, in bytes (a counter name's own limit).
pub const LIST_PREFIX_BYTES_MAX: usize = 255;

/// One page of counter names.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CounterPage {
    /// Names in byte order, all starting with the prefix asked for.
    pub counters: Vec<String>,
    /// The cursor of the next page (pass it as `after`), or `None` on the last page.
    pub next: Option<String>,
}

fn prefix_ok(prefix: &str) -> bool {
    prefix.len() <= LIST_PREFIX_BYTES_MAX
        && prefix.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b':' | b'-'))
}

/// Lists up to `limit` names starting with `prefix` that sort after `after`.
pub(crate) fn list(
    catalog: &dyn Catalog,
    prefix: &str,
    after: Option<&str>,
    limit: usize,
) -> Result<CounterPage, TallyError> {
    if limit == 0 || limit > LIST_PAGE_COUNTERS_MAX {
        return Err(ListError::Limit { got: limit, max: LIST_PAGE_COUNTERS_MAX }.into());
    }
    if !prefix_ok(prefix) {
        return Err(ListError::Prefix { max: LIST_PREFIX_BYTES_MAX }.into());
    }
    let after = after.map(CounterName::new).transpose().map_err(|_| ListError::Cursor)?;
    // One more than asked tells whether another page follows.
    let mut names = catalog.list(prefix, after.as_ref(), limit + 1)?;
    let more = names.len() > limit;
    names.truncate(limit);
    let next = if more { names.last().map(|n| n.as_str().to_string()) } else { None };
    Ok(CounterPage { counters: names.into_iter().map(|n| n.as_str().to_string()).collect(), next })
}
