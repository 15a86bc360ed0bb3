//! Misuse rejected at compile time: one case per file under `tests/ui/`, each with the
//! exact error it must produce in its `.stderr`; and what must compile, under
//! `tests/ui-pass/`.

#[test]
fn misuse_is_a_compile_error() {
    let cases = trybuild::TestCases::new();
    cases.compile_fail("tests/ui/*.rs");
    cases.pass("tests/ui-pass/*.rs");
}
