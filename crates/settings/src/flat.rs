//! Reading one flat table into several structs: `[learner]` is one table of keys, and
//! [`crate::LearnerConfig`] holds some of them as a struct of their own (its sampling rule).
//! Each key goes to the struct that declares it (serde's derive names each struct's fields),
//! its value checked by that struct as it is read, so a wrong type or an unknown key is an
//! error naming `learner.KEY`, as a plain derive's would be.

use serde::de::{self, DeserializeSeed, Deserializer, MapAccess, Visitor};
use serde_json::Value;
use toml::{Table, Value as Buffered};

/// A struct read from some of a flat table's keys: serde's derive for it, or for a struct with
/// `remote = "Self"` its inherent `deserialize`.
pub(crate) trait Flat: Sized {
    /// Reads the struct from a deserializer.
    fn read<'de, D: Deserializer<'de>>(d: D) -> Result<Self, D::Error>;
}

/// [`Flat`] for structs read by their serde derive.
macro_rules! flat_by_derive {
    ($($t:ty),+ $(,)?) => {$(
        impl $crate::flat::Flat for $t {
            fn read<'de, D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
                <Self as serde::Deserialize>::deserialize(d)
            }
        }
    )+};
}
pub(crate) use flat_by_derive;

/// One struct's share of a flat table: its keys and the entries read for it so far, kept as
/// TOML values (they hold every float a config can, infinities included, which a check must
/// see to refuse).
pub(crate) struct FlatGroup {
    fields: &'static [&'static str],
    check: fn(&str, Buffered) -> Result<(), toml::de::Error>,
    entries: Table,
}

impl FlatGroup {
    /// The group of struct `T`.
    pub(crate) fn of<T: Flat>() -> Self {
        Self {
            fields: fields_of::<T>(),
            check: check_one::<T>,
            entries: Table::new(),
        }
    }

    /// The struct, from the entries read for it (its defaults for the rest).
    pub(crate) fn into_value<T: Flat, E: de::Error>(self) -> Result<T, E> {
        T::read(Buffered::Table(self.entries)).map_err(E::custom)
    }
}

/// Reads a map whose keys are spread over `groups`: each key is checked by the struct that
/// declares it as its value is read; a key no struct declares is an unknown field.
pub(crate) fn read_groups<'de, D: Deserializer<'de>, const N: usize>(
    d: D,
    groups: [FlatGroup; N],
) -> Result<[FlatGroup; N], D::Error> {
    d.deserialize_map(GroupsVisitor(groups))
}

/// The serialized groups as one flat map (each must serialize as a map).
pub(crate) fn flat_fields<const N: usize>(
    groups: [Result<Value, serde_json::Error>; N],
) -> Result<Value, serde_json::Error> {
    let mut all = serde_json::Map::new();
    for g in groups {
        match g? {
            Value::Object(m) => all.extend(m),
            other => {
                return Err(serde::ser::Error::custom(format!(
                    "a flat group serialized as {other}, not a map"
                )))
            }
        }
    }
    Ok(Value::Object(all))
}

/// Whether `key = value` reads as a field of `T` (its other fields at their defaults).
fn check_one<T: Flat>(key: &str, value: Buffered) -> Result<(), toml::de::Error> {
    let mut one = Table::new();
    one.insert(key.to_string(), value);
    T::read(Buffered::Table(one)).map(|_| ())
}

/// The fields serde's derive asks for when it reads `T` (renames applied).
fn fields_of<T: Flat>() -> &'static [&'static str] {
    let mut probe = FieldProbe(None);
    let _ = T::read(&mut probe);
    probe.0.unwrap_or(&[])
}

/// A deserializer that reads nothing and keeps the field names a derived struct asks it for:
/// a struct's keys from serde itself instead of a list kept by hand.
pub(crate) struct FieldProbe(pub(crate) Option<&'static [&'static str]>);

impl<'de> Deserializer<'de> for &mut FieldProbe {
    type Error = de::value::Error;
    fn deserialize_any<V: Visitor<'de>>(self, _: V) -> Result<V::Value, Self::Error> {
        Err(de::Error::custom("not a struct"))
    }
    fn deserialize_struct<V: Visitor<'de>>(
        self,
        _name: &'static str,
        fields: &'static [&'static str],
        _visitor: V,
    ) -> Result<V::Value, Self::Error> {
        self.0 = Some(fields);
        Err(de::Error::custom("fields read"))
    }
    serde::forward_to_deserialize_any! {
        bool i8 i16 i32 i64 i128 u8 u16 u32 u64 u128 f32 f64 char str string bytes byte_buf
        option unit unit_struct newtype_struct seq tuple tuple_struct map enum identifier
        ignored_any
    }
}

struct GroupsVisitor<const N: usize>([FlatGroup; N]);

impl<'de, const N: usize> Visitor<'de> for GroupsVisitor<N> {
    type Value = [FlatGroup; N];

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a table of settings")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let mut groups = self.0;
        while let Some(key) = map.next_key::<String>()? {
            let Some(g) = groups.iter_mut().find(|g| g.fields.contains(&key.as_str())) else {
                // Refused inside the value, so the error's path names the key.
                let all: Vec<&str> = groups
                    .iter()
                    .flat_map(|g| g.fields.iter().copied())
                    .collect();
                map.next_value_seed(Unknown { key: &key, all })?;
                continue;
            };
            // A null (an unset option, as JSON writes it) leaves the field at its default.
            if let Some(value) = map.next_value_seed(Checked {
                key: &key,
                check: g.check,
            })? {
                g.entries.insert(key, value);
            }
        }
        Ok(groups)
    }
}

/// A value read and checked by its group's struct; `None` for a null.
struct Checked<'k> {
    key: &'k str,
    check: fn(&str, Buffered) -> Result<(), toml::de::Error>,
}

impl<'de> DeserializeSeed<'de> for Checked<'_> {
    type Value = Option<Buffered>;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Option<Buffered>, D::Error> {
        let value = <Option<Buffered> as serde::Deserialize>::deserialize(d)?;
        if let Some(v) = &value {
            (self.check)(self.key, v.clone()).map_err(|e| de::Error::custom(e.message()))?;
        }
        Ok(value)
    }
}

/// The refusal of a key no group declares.
struct Unknown<'k> {
    key: &'k str,
    all: Vec<&'static str>,
}

impl<'de> DeserializeSeed<'de> for Unknown<'_> {
    type Value = ();

    fn deserialize<D: Deserializer<'de>>(self, _d: D) -> Result<(), D::Error> {
        let expected: Vec<String> = self.all.iter().map(|f| format!("`{f}`")).collect();
        Err(de::Error::custom(format!(
            "unknown field `{}`, expected one of {}",
            self.key,
            expected.join(", ")
        )))
    }
}
