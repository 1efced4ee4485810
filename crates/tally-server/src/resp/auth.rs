//! Authentication of RESP connections: the one place `AUTH` and `HELLO ... AUTH`
//! are decided. No credentials are configured on a node yet, so every attempt gets
//! Redis's own answer for a server without a password, and every connection is
//! allowed in without one. When nodes grow tokens, this function checks them and
//! the session records who authenticated.

use super::wire::Reply;

/// Redis's answer to `AUTH` when no password is configured.
pub const NO_PASSWORD_CONFIGURED: &str =
    "ERR AUTH <password> called without any password configured for the \
     default user. Are you sure your configuration is correct?";

/// Decides an authentication attempt by `user` (`default` when left out) with
/// `password`: `Ok` lets the connection in, `Err` is the reply to send.
pub fn authenticate(user: Option<&[u8]>, password: &[u8]) -> Result<(), Reply> {
    let _ = (user, password);
    Err(Reply::Error(NO_PASSWORD_CONFIGURED.into()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn without_configured_credentials_every_attempt_gets_redis_answer() {
        for user in [None, Some(&b"default"[..]), Some(&b"admin"[..])] {
            assert_eq!(authenticate(user, b"secret"), Err(Reply::Error(NO_PASSWORD_CONFIGURED.into())));
        }
    }
}
