//! Policy bundle parsing and validation: any text either fails with an error naming a field, or
//! yields a bundle whose canonical form parses back to the same checksum and rules.
#![no_main]

use allot_shared::policy::parse_bundle;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let Ok(draft) = parse_bundle(text) else {
        return;
    };
    let Ok(bundle) = draft.into_file_bundle() else {
        return;
    };
    assert!(bundle.rules().len() <= allot_shared::policy::MAX_RULES_PER_BUNDLE);
    let again = parse_bundle(&bundle.to_json().to_string())
        .and_then(|draft| draft.into_verified())
        .expect("a bundle's own JSON parses and verifies");
    assert_eq!(again.checksum(), bundle.checksum());
    assert_eq!(again.rules(), bundle.rules());
});
