// A type whose attribute is wrong, used everywhere a working one can be: only the
// attribute's error is reported. The derive emits a stand-in implementation beside its
// errors, so `OrderPlaced::claim`, `enqueue`, a `T: Outbox` bound, `migrations()` and a
// constant read from `SPEC` do not each add an error of their own.
use outbox::Outbox;

#[derive(outbox::Outbox, Debug)]
#[outbox(lease = "soon")]
struct OrderPlaced {
    customer: String,
}

const TABLE: &str = OrderPlaced::SPEC.table();

fn table_of<T: Outbox>() -> &'static str {
    T::SPEC.table()
}

async fn publish(pool: &sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
    outbox::migrate(pool, &[OrderPlaced::migrations()]).await?;
    let mut tx = pool.begin().await?;
    let event = OrderPlaced { customer: "ada".to_owned() };
    event.enqueue(&mut *tx).await?;
    OrderPlaced::enqueue_all(&[event], &mut *tx).await?;
    tx.commit().await?;
    if let Some(claim) = OrderPlaced::claim(pool).await? {
        println!("{}", claim.event().customer);
        claim.complete(pool).await?;
    }
    for claim in OrderPlaced::claim_batch(pool, 10).await? {
        claim.complete(pool).await?;
    }
    println!("{TABLE} {}", table_of::<OrderPlaced>());
    Ok(())
}

fn main() {
    let _ = publish;
}
