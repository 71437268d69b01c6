//! Whole numbers as JSON carries them. JSON has one number type: `5` and `5.0` are the same number,
//! and JSON Schema's `integer` admits both. Fields that take a whole number accept either spelling
//! (`#[serde(deserialize_with = "json_number::whole")]`), and refuse a fraction, a negative or a
//! value past 2^53 (where a double stops being exact, so no JSON reader agrees on it) with a
//! message that says so. Schemas state the same range ([`MAX_WHOLE`]).

use serde::de::{self, Deserializer, Visitor};

/// Largest whole number accepted: 2^53, the last a JSON double carries exactly.
pub const MAX_WHOLE: u64 = 1 << 53;

#[allow(clippy::cast_precision_loss)] // 2^53 is exact in a double.
const MAX_EXACT: f64 = MAX_WHOLE as f64;

fn too_large<E: de::Error>(value: impl std::fmt::Display) -> E {
    E::custom(format!(
        "must be a non-negative whole number of at most 2^53, not {value}"
    ))
}

struct Whole;

impl Visitor<'_> for Whole {
    type Value = u64;

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("a non-negative whole number")
    }

    fn visit_u64<E: de::Error>(self, value: u64) -> Result<u64, E> {
        if value > MAX_WHOLE {
            return Err(too_large(value));
        }
        Ok(value)
    }

    fn visit_i64<E: de::Error>(self, value: i64) -> Result<u64, E> {
        let value = u64::try_from(value).map_err(|_| E::custom("must not be negative"))?;
        self.visit_u64(value)
    }

    fn visit_f64<E: de::Error>(self, value: f64) -> Result<u64, E> {
        if value.fract() != 0.0 || !(0.0..=MAX_EXACT).contains(&value) {
            return Err(too_large(value));
        }
        // Exact: whole, non-negative and within 2^53.
        #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
        Ok(value as u64)
    }
}

/// A non-negative whole number, written `5` or `5.0`.
pub fn whole<'de, D: Deserializer<'de>>(deserializer: D) -> Result<u64, D::Error> {
    deserializer.deserialize_any(Whole)
}

/// [`whole`], or `null` / absent (with `#[serde(default)]`).
pub fn optional_whole<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Option<u64>, D::Error> {
    struct Optional;
    impl<'de> Visitor<'de> for Optional {
        type Value = Option<u64>;
        fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("a non-negative whole number or null")
        }
        fn visit_none<E: de::Error>(self) -> Result<Option<u64>, E> {
            Ok(None)
        }
        fn visit_unit<E: de::Error>(self) -> Result<Option<u64>, E> {
            Ok(None)
        }
        fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<Option<u64>, D::Error> {
            whole(d).map(Some)
        }
    }
    deserializer.deserialize_option(Optional)
}

#[cfg(test)]
mod tests {
    use serde::Deserialize;

    #[derive(Debug, Deserialize)]
    struct Cost {
        #[serde(deserialize_with = "super::whole")]
        units: u64,
        #[serde(default, deserialize_with = "super::optional_whole")]
        epoch: Option<u64>,
    }

    fn read(json: &str) -> Result<Cost, String> {
        serde_json::from_str(json).map_err(|e| e.to_string())
    }

    #[test]
    fn both_spellings_of_a_whole_number_are_read_and_fractions_are_refused() {
        assert_eq!(read(r#"{"units": 5}"#).expect("5").units, 5);
        assert_eq!(read(r#"{"units": 5.0}"#).expect("5.0").units, 5);
        assert_eq!(read(r#"{"units": 5e2}"#).expect("5e2").units, 500);
        assert_eq!(
            read(r#"{"units": 9007199254740992}"#).expect("2^53").units,
            1 << 53
        );
        assert!(read(r#"{"units": 9007199254740993}"#).is_err(), "past 2^53");
        assert!(read(r#"{"units": 18446744073709551615}"#).is_err());
        assert!(
            read(r#"{"units": 5.5}"#)
                .expect_err("fraction")
                .contains("whole")
        );
        assert!(
            read(r#"{"units": -1}"#)
                .expect_err("negative")
                .contains("negative")
        );
        assert!(read(r#"{"units": -1.0}"#).is_err());
        assert!(
            read(r#"{"units": 1e300}"#)
                .expect_err("huge")
                .contains("2^53")
        );
        assert!(
            read(r#"{"units": "5"}"#).is_err(),
            "a string is not a number"
        );
        assert_eq!(
            read(r#"{"units": 1, "epoch": 7.0}"#).expect("epoch").epoch,
            Some(7)
        );
        assert_eq!(
            read(r#"{"units": 1, "epoch": null}"#).expect("null").epoch,
            None
        );
        assert_eq!(read(r#"{"units": 1}"#).expect("absent").epoch, None);
    }
}
