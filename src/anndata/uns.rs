//! `uns` and other nested groups, read as JSON values (scalars, strings, small arrays, dicts).

use hdf5::Group;
use serde_json::{json, Value};

use super::dataframe::Column;
use super::h5util::{encoding_type, is_bool, is_string, read_bools, read_scalar_string, read_strings};

/// Read a group recursively. Arrays are read whole: call this on `uns`, not on X.
pub fn read_group(g: &Group) -> Value {
    let mut map = serde_json::Map::new();
    for name in g.member_names().unwrap_or_default() {
        let v = match g.loc_type_by_name(&name) {
            Ok(hdf5::LocationType::Group) => match g.group(&name) {
                Ok(sub) => match encoding_type(&sub).as_deref() {
                    Some("dict") | None => read_group(&sub),
                    Some("categorical" | "nullable-integer" | "nullable-boolean" | "nullable-string-array") => {
                        let path = std::path::PathBuf::from(g.filename());
                        match super::dataframe::read_column(&path, g, &name, &name) {
                            Ok(col) => column_json(&col),
                            Err(_) => Value::Null,
                        }
                    }
                    Some("dataframe") => {
                        let path = std::path::PathBuf::from(g.filename());
                        match super::dataframe::read_dataframe(&path, &sub, &name) {
                            Ok(df) => {
                                let cols: serde_json::Map<String, Value> = df.columns.iter().map(|(n, c)| (n.clone(), column_json(c))).collect();
                                json!({ "encoding-type": "dataframe", "index": df.index, "columns": cols })
                            }
                            Err(_) => json!({ "encoding-type": "dataframe" }),
                        }
                    }
                    Some(other) => json!({ "encoding-type": other }),
                },
                Err(_) => Value::Null,
            },
            Ok(hdf5::LocationType::Dataset) => match g.dataset(&name) {
                Ok(ds) => read_dataset(&ds),
                Err(_) => Value::Null,
            },
            _ => Value::Null,
        };
        map.insert(name, v);
    }
    Value::Object(map)
}

/// A dataframe column as a JSON array: missing values are null.
fn column_json(col: &Column) -> Value {
    match col {
        Column::Numeric(v) => json!(v),
        Column::Bool(v) => json!(v),
        Column::NullableInt { values, mask } => Value::Array(values.iter().zip(mask).map(|(v, &m)| if m { Value::Null } else { json!(v) }).collect()),
        Column::NullableBool { values, mask } => Value::Array(values.iter().zip(mask).map(|(v, &m)| if m { Value::Null } else { json!(v) }).collect()),
        other => Value::Array(other.as_labels().unwrap_or_default().into_iter().map(|l| l.map(Value::String).unwrap_or(Value::Null)).collect()),
    }
}

fn read_dataset(ds: &hdf5::Dataset) -> Value {
    let path = std::path::PathBuf::from(ds.filename());
    if super::h5util::check_backed(&path, &ds.name(), ds).is_err() {
        return Value::Null;
    }
    let scalar = ds.ndim() == 0;
    if is_string(ds) {
        return if scalar {
            read_scalar_string(ds).map(Value::String).unwrap_or(Value::Null)
        } else {
            read_strings(ds).map(|v| json!(v)).unwrap_or(Value::Null)
        };
    }
    if is_bool(ds) {
        let v = read_bools(ds).unwrap_or_default();
        return if scalar { v.first().map(|&b| json!(b)).unwrap_or(Value::Null) } else { json!(v) };
    }
    let is_int = matches!(
        ds.dtype().and_then(|t| t.to_descriptor()),
        Ok(hdf5::types::TypeDescriptor::Integer(_) | hdf5::types::TypeDescriptor::Unsigned(_))
    );
    if is_int {
        let v: Vec<i64> = ds.read_raw().unwrap_or_default();
        return if scalar { v.first().map(|&x| json!(x)).unwrap_or(Value::Null) } else { json!(v) };
    }
    let v: Vec<f64> = ds.read_raw().unwrap_or_default();
    if scalar {
        v.first().map(|&x| json!(x)).unwrap_or(Value::Null)
    } else {
        json!(v)
    }
}
