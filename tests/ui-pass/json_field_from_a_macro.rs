// An event type written by a `macro_rules!`, the type of its json field a fragment of
// the macro's input: the derive's own names resolve whatever the field type's origin.
#[derive(serde::Serialize, serde::Deserialize)]
struct Line {
    sku: String,
}

macro_rules! event {
    ($name:ident, $lines:ty) => {
        #[derive(outbox::Outbox)]
        #[outbox(table = "macro_events")]
        struct $name {
            customer: String,
            #[outbox(json)]
            lines: $lines,
            #[outbox(json)]
            note: Option<$lines>,
        }
    };
}

event!(OrderPlaced, Vec<Line>);

fn main() {
    let _ = OrderPlaced::migrations();
}
