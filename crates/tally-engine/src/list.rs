//! Listing counters by name: one bounded page at a time, in byte order of the names,
//! so an operator (or `GET /v1/counters`) can walk millions of counters without any
//! one call scanning them all.

use crate::catalog::Catalog;
use crate::error::{ListError, TallyError};
use serde::{Deserialize, Serialize};
use tally_core::CounterName;

/// Most counters one page lists: bounds the work (and the answer) of one call.
pub const LIST_PAGE_COUNTERS_MAX: usize = 1000;
/// Longest prefix accepted, in bytes of its escaped form (a counter name's own
/// limit: `tally_core::name::NAME_LEN_MAX`).
pub const LIST_PREFIX_BYTES_MAX: usize = tally_core::name::NAME_LEN_MAX;

/// One page of counter names.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CounterPage {
    /// Names in byte order, all starting with the prefix asked for.
    pub counters: Vec<String>,
    /// The cursor of the next page (pass it as `after`), or `None` on the last page.
    pub next: Option<String>,
}

/// Whether `prefix` is the escaped form of a possible start of a name (or empty).
fn prefix_ok(prefix: &str) -> bool {
    prefix.is_empty() || (prefix.len() <= LIST_PREFIX_BYTES_MAX && CounterName::new(prefix).is_ok())
}

/// Lists up to `limit` names starting with `prefix` that sort after `after`,
/// leaving out counters expired at `now_ms` (a page may then hold fewer than
/// `limit`; `next` still says where the next one starts).
pub(crate) fn list(
    catalog: &dyn Catalog,
    prefix: &str,
    after: Option<&str>,
    limit: usize,
    now_ms: u64,
) -> Result<CounterPage, TallyError> {
    if limit == 0 || limit > LIST_PAGE_COUNTERS_MAX {
        return Err(ListError::Limit { got: limit, max: LIST_PAGE_COUNTERS_MAX }.into());
    }
    if !prefix_ok(prefix) {
        return Err(ListError::Prefix { max: tally_core::name::NAME_BYTES_MAX }.into());
    }
    let after = after.map(CounterName::new).transpose().map_err(|_| ListError::Cursor)?;
    // One more than asked tells whether another page follows.
    let mut names = catalog.list(prefix, after.as_ref(), limit + 1)?;
    let more = names.len() > limit;
    names.truncate(limit);
    let next = if more { names.last().map(|n| n.as_str().to_string()) } else { None };
    let mut counters = Vec::with_capacity(names.len());
    for n in names {
        let expired = catalog.get(n.as_str())?.is_some_and(|m| m.expired(now_ms));
        if !expired {
            counters.push(n.as_str().to_string());
        }
    }
    Ok(CounterPage { counters, next })
}
