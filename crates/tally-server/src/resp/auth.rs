//! Authentication and authorization of RESP connections, over the node's
//! [`Gate`] (the same tokens, scopes, prefixes, audit trail and metrics as HTTP).
//!
//! * A node without tokens is open: every connection starts as the open principal,
//!   and `AUTH` gets Redis's answer for a server without a password.
//! * A node with tokens: a connection starts unauthenticated and may only run
//!   `AUTH`, `HELLO … AUTH`, `QUIT` (and `HELLO` naming credentials); anything else
//!   answers `-NOAUTH`, as Redis does with `requirepass`. `AUTH TOKEN` (or
//!   `AUTH user TOKEN`; the user name is not checked, the token names itself)
//!   authenticates it; a wrong token answers `-WRONGPASS`.
//! * Every command then needs the scope HTTP needs for the same operation on each
//!   counter it names: reads `read`, increments `write`, spec changes, deletions and
//!   reconciliations `admin`; a refusal answers `-NOPERM` and is audited.

use super::command::{Command, NamespaceOp};

/// The prefix every counter name starts with: what a token needs to be without
/// prefixes to cover.
const ALL: &[String] = &[String::new()];
use super::wire::Reply;
use crate::auth::{Attempt, AuthError, Gate, Principal, Resource, Scope};
use crate::metrics::AdminOp;
use std::sync::Arc;

/// Redis's answer to `AUTH` when no password is configured.
pub const NO_PASSWORD_CONFIGURED: &str =
    "ERR AUTH <password> called without any password configured for the \
     default user. Are you sure your configuration is correct?";

/// Redis's answer to a command sent before authenticating.
pub const NOAUTH: &str = "NOAUTH Authentication required.";

/// Redis's answer to a wrong password.
pub const WRONGPASS: &str = "WRONGPASS invalid username-password pair or user is disabled.";

/// The principal a new connection starts as: the open one on a node without
/// tokens, none (unauthenticated) otherwise.
pub fn initial(gate: &Gate) -> Option<Arc<Principal>> {
    gate.is_open().then(|| Arc::new(Principal::open()))
}

/// Decides `AUTH [user] password`: the principal to run as, or the reply to send.
pub fn authenticate(gate: &Gate, password: &[u8]) -> Result<Arc<Principal>, Reply> {
    if gate.is_open() {
        return Err(Reply::Error(NO_PASSWORD_CONFIGURED.into()));
    }
    let attempt = Attempt { transport: "resp", op: "AUTH", counter: None, node: None };
    let token = std::str::from_utf8(password).unwrap_or("");
    gate.verify(token, &attempt).map_err(|_| Reply::Error(WRONGPASS.into()))
}

/// What a command needs of the connection.
enum Need<'a> {
    /// Runs before authentication (it is how one authenticates, or leaves).
    Nothing,
    /// Needs an authenticated connection and nothing more.
    Authenticated,
    /// Needs `scope` on every counter named.
    Counters(Scope, &'a [String]),
}

fn need(cmd: &Command) -> Need<'_> {
    use Command as C;
    match cmd {
        // `HELLO` without credentials on an unauthenticated connection gets Redis's
        // own `NOAUTH` text from the command itself.
        C::Auth { .. } | C::Quit | C::Hello { .. } => Need::Nothing,
        C::Ping(_)
        | C::Echo(_)
        | C::Select(_)
        | C::ClientSetName(_)
        | C::ClientGetName
        | C::ClientSetInfo { .. }
        | C::ClientId
        | C::Command(_)
        | C::Info(_)
        | C::Multi
        | C::Exec
        | C::Discard
        | C::Watch(_)
        | C::Unwatch
        | C::ClientInfo
        | C::ConfigGet(_)
        | C::ConfigOther(_)
        | C::Wait { .. } => Need::Authenticated,
        // Listings are narrowed to the token's prefixes by the command itself.
        C::Scan(_) | C::Keys(_) => Need::Authenticated,
        // Other connections' addresses and names, and closing them: an operator's.
        C::ClientList | C::ClientKill(_) => Need::Counters(Scope::Admin, ALL),
        C::DbSize => Need::Counters(Scope::Read, ALL),
        C::Type(key) | C::CmsInfo(key) | C::TopkInfo(key) | C::TopkQuery { key, .. } => {
            Need::Counters(Scope::Read, std::slice::from_ref(key))
        }
        C::PfCount(keys) => Need::Counters(Scope::Read, keys),
        C::CmsIncrBy { key, .. } | C::TopkIncrBy { key, .. } => {
            Need::Counters(Scope::Write, std::slice::from_ref(key))
        }
        // Creating a counter with a spec is `admin`, as `TALLY.CREATE` is.
        C::CmsInit { key, .. } | C::TopkReserve { key, .. } => {
            Need::Counters(Scope::Admin, std::slice::from_ref(key))
        }
        C::PfMerge { dest, .. } => Need::Counters(Scope::Write, std::slice::from_ref(dest)),
        C::CmsMerge { dest, .. } => Need::Counters(Scope::Admin, std::slice::from_ref(dest)),
        C::Incr { key, .. }
        | C::IncrEx { key, .. }
        | C::TallyIncrBy { key, .. }
        | C::PfAdd { key, .. }
        | C::Expire { key, .. }
        | C::Persist(key)
        | C::GetEx { key, .. } => Need::Counters(Scope::Write, std::slice::from_ref(key)),
        C::Ttl { key, .. } => Need::Counters(Scope::Read, std::slice::from_ref(key)),
        // An absolute write is a correction, and a deletion a deletion: `admin`, as
        // `POST …/reconcile` and `DELETE` over HTTP.
        C::Set { key, .. } | C::GetDel(key) => Need::Counters(Scope::Admin, std::slice::from_ref(key)),
        // A namespace decides the contract of every counter under its prefix: as if
        // the prefix were a counter (a token's prefixes must cover it); listing
        // needs a token without prefixes, as `GET /v1/namespaces`.
        C::TallyNamespace(NamespaceOp::Set { prefix, .. } | NamespaceOp::Del(prefix)) => {
            Need::Counters(Scope::Admin, std::slice::from_ref(prefix))
        }
        C::TallyNamespace(NamespaceOp::Get(prefix)) => {
            Need::Counters(Scope::Read, std::slice::from_ref(prefix))
        }
        C::TallyNamespace(NamespaceOp::List) => Need::Counters(Scope::Read, ALL),
        C::Get(key)
        | C::CmsQuery { key, .. }
        | C::TopkList { key, .. }
        | C::TallyGet { key, .. }
        | C::TallyWindow { key, .. }
        | C::TallyShards(key) => Need::Counters(Scope::Read, std::slice::from_ref(key)),
        C::MGet(keys) | C::Exists(keys) => Need::Counters(Scope::Read, keys),
        C::Del(keys) => Need::Counters(Scope::Admin, keys),
        C::TallyCreate { key, .. } | C::TallyReconcile { key, .. } => {
            Need::Counters(Scope::Admin, std::slice::from_ref(key))
        }
    }
}

/// Whether the connection running as `principal` may create `key` with a spec of
/// its own, as `PFADD` does with an unknown counter (`distinct: true`, where
/// incrementing an unknown counter takes its namespace's or the node's spec): that
/// is a spec change, so it needs `admin` on the counter as `TALLY.CREATE` does; a
/// `write` token gets `-NOPERM`, audited, and nothing is created.
pub fn may_create(gate: &Gate, principal: Option<&Principal>, key: &str) -> Result<(), Reply> {
    let Some(principal) = principal else { return Err(Reply::Error(NOAUTH.into())) };
    let attempt = Attempt { transport: "resp", op: "PFADD", counter: Some(key), node: None };
    gate.authorize(principal, Scope::Admin, Resource::Counter(key), &attempt).map_err(|e| {
        Reply::Error(format!(
            "NOPERM this token has no permission to create counter {key:?} with DISTINCT (pfadd on an \
             unknown counter creates it with a spec of its own): {e}; create it first with TALLY.CREATE \
             {key} DISTINCT true"
        ))
    })
}

/// The admin operation a command is, for the audit trail.
pub fn admin_op(cmd: &Command) -> Option<AdminOp> {
    match cmd {
        Command::Del(_) | Command::GetDel(_) => Some(AdminOp::DeleteCounter),
        Command::Set { .. } => Some(AdminOp::Reconcile),
        Command::TallyCreate { .. } => Some(AdminOp::PutCounter),
        Command::TallyReconcile { .. } => Some(AdminOp::Reconcile),
        _ => None,
    }
}

/// Whether the connection running as `principal` may run `cmd` (named `op`); the
/// refusal reply otherwise. Refusals of counters are audited by the gate.
pub fn admit(gate: &Gate, principal: Option<&Principal>, op: &str, cmd: &Command) -> Result<(), Reply> {
    let need = need(cmd);
    if matches!(need, Need::Nothing) {
        return Ok(());
    }
    let Some(principal) = principal else {
        return Err(Reply::Error(NOAUTH.into()));
    };
    if let Need::Counters(scope, keys) = need {
        for key in keys {
            let attempt = Attempt { transport: "resp", op, counter: Some(key), node: None };
            if let Err(e) = gate.authorize(principal, scope, Resource::Counter(key), &attempt) {
                return Err(no_permission(&e, op));
            }
        }
    }
    Ok(())
}

/// Records an admin command's outcome in the audit trail and metrics, with the
/// HTTP status its reply stands for (an error code of a node that could not serve
/// counts as failed, any other error as rejected).
pub fn audit_admin(gate: &Gate, principal: Option<&Principal>, op: &str, cmd: &Command, reply: &Reply) {
    let (Some(admin), Some(principal)) = (admin_op(cmd), principal) else { return };
    let counter = match cmd {
        Command::Del(keys) => keys.first().map(String::as_str),
        Command::TallyCreate { key, .. }
        | Command::TallyReconcile { key, .. }
        | Command::Set { key, .. }
        | Command::GetDel(key) => Some(key.as_str()),
        _ => None,
    };
    let attempt = Attempt { transport: "resp", op, counter, node: None };
    let code = match reply {
        Reply::Error(text) => Some(text.split_whitespace().nth(1).unwrap_or("error")),
        _ => None,
    };
    let status = match code {
        None => 200,
        Some("storage_failure" | "shard_unavailable" | "shutting_down" | "timeout" | "internal") => 503,
        Some(_) => 409,
    };
    gate.admin_done(principal, admin, &attempt, status, code);
}

fn no_permission(e: &AuthError, op: &str) -> Reply {
    Reply::Error(format!("NOPERM this token has no permission to run '{}': {e}", op.to_ascii_lowercase()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use tally_auth::{TokenConfig, TokenHash, Tokens};

    fn gate() -> Gate {
        let token = |name: &str, scopes: &[&str], prefixes: &[&str]| TokenConfig {
            name: name.into(),
            hash: TokenHash::of(&format!("secret-{name}")).to_config(),
            scopes: scopes.iter().map(|s| Scope::parse(s).unwrap()).collect(),
            prefixes: prefixes.iter().map(|s| s.to_string()).collect(),
        };
        let tokens = Tokens::from_config(&[
            token("reader", &["read"], &[]),
            token("likes", &["read", "write"], &["likes:"]),
            token("root", &["admin", "read", "write"], &[]),
        ])
        .unwrap();
        Gate::new(tokens)
    }

    fn incr(key: &str) -> Command {
        Command::Incr { key: key.into(), delta: 1 }
    }

    #[test]
    fn an_open_node_lets_everyone_in_and_answers_auth_as_redis_does() {
        let open = Gate::open();
        let principal = initial(&open).expect("open principal");
        assert_eq!(admit(&open, Some(&principal), "DEL", &Command::Del(vec!["x".into()])), Ok(()));
        assert_eq!(authenticate(&open, b"anything"), Err(Reply::Error(NO_PASSWORD_CONFIGURED.into())));
    }

    #[test]
    fn a_node_with_tokens_wants_auth_first() {
        let g = gate();
        assert!(initial(&g).is_none());
        assert_eq!(admit(&g, None, "INCR", &incr("likes:1")), Err(Reply::Error(NOAUTH.into())));
        assert_eq!(admit(&g, None, "PING", &Command::Ping(None)), Err(Reply::Error(NOAUTH.into())));
        let auth = Command::Auth { user: None, password: b"x".to_vec() };
        assert_eq!(admit(&g, None, "AUTH", &auth), Ok(()));
        assert_eq!(admit(&g, None, "QUIT", &Command::Quit), Ok(()));
        assert_eq!(authenticate(&g, b"wrong"), Err(Reply::Error(WRONGPASS.into())));
        assert_eq!(authenticate(&g, b"secret-reader").unwrap().name(), Some("reader"));
    }

    #[test]
    fn commands_need_the_scope_http_needs_on_every_counter_they_name() {
        let g = gate();
        let reader = authenticate(&g, b"secret-reader").unwrap();
        let likes = authenticate(&g, b"secret-likes").unwrap();
        let root = authenticate(&g, b"secret-root").unwrap();
        let refused = |r: Result<(), Reply>| matches!(r, Err(Reply::Error(ref e)) if e.starts_with("NOPERM"));

        assert_eq!(admit(&g, Some(&reader), "GET", &Command::Get("credits:1".into())), Ok(()));
        assert!(refused(admit(&g, Some(&reader), "INCR", &incr("credits:1"))));
        assert_eq!(admit(&g, Some(&likes), "INCR", &incr("likes:1")), Ok(()));
        assert!(refused(admit(&g, Some(&likes), "INCR", &incr("credits:1"))));
        let mget = Command::MGet(vec!["likes:1".into(), "credits:1".into()]);
        assert!(refused(admit(&g, Some(&likes), "MGET", &mget)), "every key is checked");
        let del = Command::Del(vec!["likes:1".into()]);
        assert!(refused(admit(&g, Some(&likes), "DEL", &del)), "deleting needs admin");
        assert_eq!(admit(&g, Some(&root), "DEL", &del), Ok(()));
        assert_eq!(admit(&g, Some(&reader), "PING", &Command::Ping(None)), Ok(()));
        assert_eq!(admin_op(&del), Some(AdminOp::DeleteCounter));
        // PFADD creating an unknown counter (distinct) is a spec change: admin only.
        assert!(
            matches!(may_create(&g, Some(&likes), "likes:new"), Err(Reply::Error(ref e)) if e.starts_with("NOPERM"))
        );
        assert_eq!(may_create(&g, Some(&root), "likes:new"), Ok(()));
        assert_eq!(may_create(&Gate::open(), Some(&Principal::open()), "x"), Ok(()));
        assert_eq!(admin_op(&incr("x")), None);
        // Every refusal was counted by the gate.
        let refused: u64 = g.stats().refusals.iter().map(|c| c.get()).sum();
        assert_eq!(refused, 5);
    }
}
