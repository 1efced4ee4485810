//! A PostgreSQL source of truth: one parameterized query per counter, through a
//! small connection pool, each step bounded by a timeout.
//!
//! The query's parameters are the counter pattern's placeholders (`likes:{id}` →
//! `$1 = id`), converted to what the server says the parameter is (`smallint`,
//! `integer`, `bigint`, or any text type). Its one row's one column is the total:
//! `smallint`, `integer` or `bigint` (a `NULL`, as `sum` gives over no rows, is 0).
//! Cast a `numeric` (what `sum(bigint)` returns) with `::bigint`.
//!
//! With `sslmode=verify-full` (or `verify-ca`) and `sslrootcert=FILE` in the
//! connection string, every connection runs TLS and checks the server's certificate
//! ([`super::pg_tls`]).

use super::config::PostgresSource;
use super::pg_tls::{RustlsConnect, TlsParams};
use deadpool_postgres::{Manager, ManagerConfig, Pool, RecyclingMethod, Runtime};
use std::time::Duration;
use tokio_postgres::types::{ToSql, Type};
use tokio_postgres::NoTls;

/// Why a PostgreSQL source could not give a total.
#[derive(Debug, thiserror::Error)]
pub enum PgSourceError {
    /// The pool could not be built from the configuration.
    #[error("cannot build the connection pool: {0}")]
    Pool(String),
    /// No connection within `connect_timeout_ms`, or the connect failed.
    #[error("cannot connect: {0}")]
    Connect(String),
    /// The query did not answer within `query_timeout_ms`.
    #[error("the query took longer than {0} ms")]
    Timeout(u64),
    /// The server refused the query (syntax, permissions, a broken connection).
    #[error("the query failed: {0}")]
    Query(String),
    /// The query's shape does not fit (parameters, rows or column type).
    #[error("{0}")]
    Shape(String),
}

/// A pooled PostgreSQL source.
pub struct PgSource {
    pool: Pool,
    query: String,
    query_timeout_ms: u64,
}

/// One query parameter, typed as the server asked.
#[derive(Debug)]
enum Param {
    I16(i16),
    I32(i32),
    I64(i64),
    Text(String),
}

impl PgSource {
    /// Builds the pool; no connection is opened until the first run.
    pub fn new(cfg: &PostgresSource) -> Result<Self, PgSourceError> {
        let params = TlsParams::split(&cfg.url).map_err(PgSourceError::Pool)?;
        let mut pg: tokio_postgres::Config =
            params.url.parse().map_err(|e| PgSourceError::Pool(format!("{e}")))?;
        let connect = Duration::from_millis(cfg.connect_timeout_ms);
        pg.connect_timeout(connect);
        if pg.get_application_name().is_none() {
            pg.application_name("tallyd-reconciler");
        }
        let recycling = || ManagerConfig { recycling_method: RecyclingMethod::Fast };
        let manager = match &params.tls {
            None => Manager::from_config(pg, NoTls, recycling()),
            Some((mode, root)) => {
                let tls = RustlsConnect::new(*mode, root).map_err(PgSourceError::Pool)?;
                Manager::from_config(pg, tls, recycling())
            }
        };
        let pool = Pool::builder(manager)
            .max_size(usize::try_from(cfg.pool_size).unwrap_or(1))
            .runtime(Runtime::Tokio1)
            .wait_timeout(Some(connect))
            .create_timeout(Some(connect))
            .recycle_timeout(Some(connect))
            .build()
            .map_err(|e| PgSourceError::Pool(e.to_string()))?;
        Ok(Self { pool, query: cfg.query.clone(), query_timeout_ms: cfg.query_timeout_ms })
    }

    /// The authoritative total for one counter whose placeholders are `values`.
    pub async fn total(&self, values: &[String]) -> Result<i128, PgSourceError> {
        let client = self.pool.get().await.map_err(|e| PgSourceError::Connect(causes(&e)))?;
        let timeout = Duration::from_millis(self.query_timeout_ms);
        let work = async {
            let stmt =
                client.prepare_cached(&self.query).await.map_err(|e| PgSourceError::Query(e.to_string()))?;
            if stmt.params().len() != values.len() {
                return Err(PgSourceError::Shape(format!(
                    "the query takes {} parameters but the counter pattern has {} placeholders",
                    stmt.params().len(),
                    values.len()
                )));
            }
            let params: Vec<Param> = stmt
                .params()
                .iter()
                .zip(values)
                .enumerate()
                .map(|(i, (t, v))| param(i + 1, t, v))
                .collect::<Result<_, _>>()?;
            let refs: Vec<&(dyn ToSql + Sync)> = params
                .iter()
                .map(|p| match p {
                    Param::I16(v) => v as &(dyn ToSql + Sync),
                    Param::I32(v) => v as &(dyn ToSql + Sync),
                    Param::I64(v) => v as &(dyn ToSql + Sync),
                    Param::Text(v) => v as &(dyn ToSql + Sync),
                })
                .collect();
            let rows = client.query(&stmt, &refs).await.map_err(|e| PgSourceError::Query(e.to_string()))?;
            let [row] = rows.as_slice() else {
                return Err(PgSourceError::Shape(format!(
                    "the query returned {} rows; it must return one",
                    rows.len()
                )));
            };
            if row.len() != 1 {
                return Err(PgSourceError::Shape(format!(
                    "the query returned {} columns; it must return one",
                    row.len()
                )));
            }
            let ty = row.columns()[0].type_().clone();
            let get = |e: tokio_postgres::Error| PgSourceError::Query(e.to_string());
            let total: Option<i128> = match ty {
                Type::INT2 => row.try_get::<_, Option<i16>>(0).map_err(get)?.map(i128::from),
                Type::INT4 => row.try_get::<_, Option<i32>>(0).map_err(get)?.map(i128::from),
                Type::INT8 => row.try_get::<_, Option<i64>>(0).map_err(get)?.map(i128::from),
                other => {
                    return Err(PgSourceError::Shape(format!(
                    "the query's column is {other}; return smallint, integer or bigint (cast with ::bigint)"
                )))
                }
            };
            Ok(total.unwrap_or(0))
        };
        tokio::time::timeout(timeout, work)
            .await
            .map_err(|_| PgSourceError::Timeout(self.query_timeout_ms))?
    }
}

/// An error with every cause under it (`error performing TLS handshake: invalid
/// peer certificate: UnknownIssuer`), for the run record and the log.
fn causes(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut next = e.source();
    while let Some(cause) = next {
        let more = cause.to_string();
        if !text.contains(&more) {
            text = format!("{text}: {more}");
        }
        next = cause.source();
    }
    text
}

/// The placeholder value `v` as parameter `$n` of type `t`.
fn param(n: usize, t: &Type, v: &str) -> Result<Param, PgSourceError> {
    let int = |what: &str| PgSourceError::Shape(format!("${n} is {what} but the counter name gives {v:?}"));
    Ok(match *t {
        Type::INT2 => Param::I16(v.parse().map_err(|_| int("smallint"))?),
        Type::INT4 => Param::I32(v.parse().map_err(|_| int("integer"))?),
        Type::INT8 => Param::I64(v.parse().map_err(|_| int("bigint"))?),
        Type::TEXT | Type::VARCHAR | Type::BPCHAR | Type::NAME | Type::UNKNOWN => Param::Text(v.to_string()),
        ref other => {
            return Err(PgSourceError::Shape(format!(
                "${n} is {other}; only smallint, integer, bigint and text parameters are filled (cast it, e.g. ${n}::text)"
            )))
        }
    })
}
