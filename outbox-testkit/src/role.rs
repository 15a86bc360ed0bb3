//! Login roles of a test's own. Roles belong to the whole cluster, not to the test's
//! schema, so they are dropped whatever the test did: returned an error or panicked.

use std::panic::AssertUnwindSafe;

use futures_util::FutureExt as _;
use outbox::testing::TestSchema;
use sqlx::AssertSqlSafe;

use super::TestResult;

/// Creates the login role `role` with `grants` (statements naming it, run as the
/// owner), runs `test`, then drops the role and everything granted to it.
pub async fn with_role<T>(
    db: &TestSchema,
    role: &str,
    grants: &str,
    test: impl Future<Output = TestResult<T>>,
) -> TestResult<T> {
    with_roles(db, &[role], grants, test).await
}

/// [`with_role`] for several roles (`grants`, if any, run once they all exist).
pub async fn with_roles<T>(
    db: &TestSchema,
    roles: &[&str],
    grants: &str,
    test: impl Future<Output = TestResult<T>>,
) -> TestResult<T> {
    for role in roles {
        sqlx::raw_sql(AssertSqlSafe(format!("CREATE ROLE {role} LOGIN")))
            .execute(db.pool())
            .await?;
    }
    if !grants.is_empty() {
        sqlx::raw_sql(AssertSqlSafe(grants.to_owned()))
            .execute(db.pool())
            .await?;
    }
    let outcome = AssertUnwindSafe(test).catch_unwind().await;
    for role in roles {
        sqlx::raw_sql(AssertSqlSafe(format!(
            "DROP OWNED BY {role}; DROP ROLE {role}"
        )))
        .execute(db.pool())
        .await?;
    }
    match outcome {
        Ok(result) => result,
        Err(panic) => std::panic::resume_unwind(panic),
    }
}
