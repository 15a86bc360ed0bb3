// The derive's expansion names everything by its path: it compiles in a module without
// the prelude, and beside the user's own items that shadow the prelude's names.

mod without_prelude {
    #![no_implicit_prelude]

    #[derive(::outbox::Outbox)]
    #[outbox(table = "no_prelude_events")]
    pub struct Shipped {
        #[outbox(event_id)]
        pub name: ::std::string::String,
        pub parcels: ::core::primitive::i64,
        pub note: ::core::option::Option<::std::string::String>,
    }
}

#[allow(dead_code, non_camel_case_types)]
mod shadowed {
    struct Result;
    struct Option;
    struct Vec;
    struct Box;
    struct Some;
    struct Ok;
    struct u32;
    struct i64;
    macro_rules! concat {
        ($($t:tt)*) => {
            "not the prelude's"
        };
    }

    #[derive(outbox::Outbox)]
    #[outbox(table = "shadowed_events")]
    pub struct Shipped {
        #[outbox(event_id)]
        pub name: std::string::String,
        pub parcels: core::primitive::i64,
    }
}

fn main() {
    let _ = without_prelude::Shipped::migrations();
    let _ = shadowed::Shipped::migrations();
}
