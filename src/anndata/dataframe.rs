//! AnnData dataframes (`obs`, `var`, `raw/var`): index plus typed columns.

use std::path::Path;

use hdf5::{Dataset, Group};

use super::h5util::{encoding_type, is_bool, is_string, read_bools, read_strings, str_array_attr, str_attr};
use crate::error::{Error, Result};

/// One dataframe column.
#[derive(Debug, Clone, PartialEq)]
pub enum Column {
    Numeric(Vec<f64>),
    Bool(Vec<bool>),
    Strings(Vec<String>),
    Categorical { codes: Vec<i64>, categories: Vec<String>, ordered: bool },
    NullableInt { values: Vec<i64>, mask: Vec<bool> },
    NullableBool { values: Vec<bool>, mask: Vec<bool> },
    NullableString { values: Vec<String>, mask: Vec<bool> },
}

impl Column {
    pub fn len(&self) -> usize {
        match self {
            Column::Numeric(v) => v.len(),
            Column::Bool(v) => v.len(),
            Column::Strings(v) => v.len(),
            Column::Categorical { codes, .. } => codes.len(),
            Column::NullableInt { values, .. } => values.len(),
            Column::NullableBool { values, .. } => values.len(),
            Column::NullableString { values, .. } => values.len(),
        }
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// A short name of the kind, as in `expected.json` fixtures and messages.
    pub fn kind(&self) -> &'static str {
        match self {
            Column::Numeric(_) => "numeric",
            Column::Bool(_) => "bool",
            Column::Strings(_) => "string",
            Column::Categorical { .. } => "categorical",
            Column::NullableInt { .. } => "nullable-integer",
            Column::NullableBool { .. } => "nullable-boolean",
            Column::NullableString { .. } => "nullable-string",
        }
    }
    /// Values as labels (categorical or string columns): `None` for missing values.
    pub fn as_labels(&self) -> Option<Vec<Option<String>>> {
        match self {
            Column::Categorical { codes, categories, .. } => Some(
                codes.iter().map(|&c| if c < 0 { None } else { categories.get(c as usize).cloned() }).collect(),
            ),
            Column::Strings(v) => Some(v.iter().cloned().map(Some).collect()),
            Column::NullableString { values, mask } => {
                Some(values.iter().zip(mask).map(|(v, &m)| if m { None } else { Some(v.clone()) }).collect())
            }
            Column::NullableInt { values, mask } => {
                Some(values.iter().zip(mask).map(|(v, &m)| if m { None } else { Some(v.to_string()) }).collect())
            }
            _ => None,
        }
    }
}

/// A dataframe: index and columns in `column-order`.
#[derive(Debug, Clone, Default)]
pub struct DataFrame {
    pub index_name: String,
    pub index: Vec<String>,
    pub columns: Vec<(String, Column)>,
}

impl DataFrame {
    pub fn column(&self, name: &str) -> Option<&Column> {
        self.columns.iter().find(|(n, _)| n == name).map(|(_, c)| c)
    }
    pub fn names(&self) -> Vec<&str> {
        self.columns.iter().map(|(n, _)| n.as_str()).collect()
    }
}

fn bad(path: &Path, field: &str, detail: impl Into<String>) -> Error {
    Error::BadField { path: path.into(), field: field.into(), detail: detail.into(), hint: None }
}

/// Read only the index of a dataframe group (cheap; used for obs/var names).
pub fn read_index(path: &Path, g: &Group, field: &str) -> Result<Vec<String>> {
    let index_name = str_attr(g, "_index").unwrap_or_else(|| "_index".into());
    let ds = g.dataset(&index_name).map_err(|_| {
        bad(path, &format!("{field}/{index_name}"), "is missing (every AnnData dataframe has an index)")
    })?;
    if is_string(&ds) {
        read_strings(&ds).ok_or_else(|| bad(path, &format!("{field}/{index_name}"), "cannot be read as strings"))
    } else {
        // numeric index: turn into strings as pandas would show them
        let v: Vec<i64> = ds.read_raw().map_err(|e| bad(path, &format!("{field}/{index_name}"), format!("cannot be read: {e}")))?;
        Ok(v.into_iter().map(|x| x.to_string()).collect())
    }
}

/// Read a whole dataframe group.
pub fn read_dataframe(path: &Path, g: &Group, field: &str) -> Result<DataFrame> {
    let index_name = str_attr(g, "_index").unwrap_or_else(|| "_index".into());
    let index = read_index(path, g, field)?;
    let order = str_array_attr(g, "column-order").unwrap_or_default();
    let mut columns = Vec::with_capacity(order.len());
    for name in order {
        let f = format!("{field}/{name}");
        let col = read_column(path, g, &name, &f)?;
        if col.len() != index.len() {
            return Err(bad(path, &f, format!("has {} values but the index has {}", col.len(), index.len())));
        }
        columns.push((name, col));
    }
    Ok(DataFrame { index_name, index, columns })
}

fn read_numeric(path: &Path, ds: &Dataset, field: &str) -> Result<Column> {
    if is_bool(ds) {
        return read_bools(ds).map(Column::Bool).ok_or_else(|| bad(path, field, "cannot be read as booleans"));
    }
    if is_string(ds) {
        return read_strings(ds).map(Column::Strings).ok_or_else(|| bad(path, field, "cannot be read as strings"));
    }
    ds.read_raw::<f64>().map(Column::Numeric).map_err(|e| bad(path, field, format!("cannot be read: {e}")))
}

fn read_column(path: &Path, g: &Group, name: &str, field: &str) -> Result<Column> {
    match g.loc_type_by_name(name) {
        Ok(hdf5::LocationType::Dataset) => {
            let ds = g.dataset(name).map_err(|e| bad(path, field, format!("cannot be opened: {e}")))?;
            read_numeric(path, &ds, field)
        }
        Ok(hdf5::LocationType::Group) => {
            let cg = g.group(name).map_err(|e| bad(path, field, format!("cannot be opened: {e}")))?;
            let enc = encoding_type(&cg).unwrap_or_default();
            let sub = |n: &str| cg.dataset(n).map_err(|_| bad(path, &format!("{field}/{n}"), "is missing"));
            match enc.as_str() {
                "categorical" => {
                    let codes: Vec<i64> = sub("codes")?.read_raw().map_err(|e| bad(path, &format!("{field}/codes"), format!("{e}")))?;
                    let cats_ds = sub("categories")?;
                    let categories = if is_string(&cats_ds) {
                        read_strings(&cats_ds).ok_or_else(|| bad(path, &format!("{field}/categories"), "unreadable"))?
                    } else {
                        let v: Vec<f64> = cats_ds.read_raw().map_err(|e| bad(path, &format!("{field}/categories"), format!("{e}")))?;
                        v.into_iter().map(|x| if x.fract() == 0.0 { format!("{}", x as i64) } else { x.to_string() }).collect()
                    };
                    let ordered = cg
                        .attr("ordered")
                        .ok()
                        .and_then(|a| a.read_scalar::<bool>().ok().or_else(|| a.read_scalar::<i8>().ok().map(|x| x != 0)))
                        .unwrap_or(false);
                    if let Some(&bad_code) = codes.iter().find(|&&c| c >= categories.len() as i64) {
                        return Err(bad(path, &format!("{field}/codes"), format!("holds code {bad_code} but there are {} categories", categories.len())));
                    }
                    Ok(Column::Categorical { codes, categories, ordered })
                }
                "nullable-integer" => {
                    let values: Vec<i64> = sub("values")?.read_raw().map_err(|e| bad(path, field, format!("{e}")))?;
                    let mask = read_bools(&sub("mask")?).ok_or_else(|| bad(path, &format!("{field}/mask"), "unreadable"))?;
                    Ok(Column::NullableInt { values, mask })
                }
                "nullable-boolean" => {
                    let values = read_bools(&sub("values")?).ok_or_else(|| bad(path, &format!("{field}/values"), "unreadable"))?;
                    let mask = read_bools(&sub("mask")?).ok_or_else(|| bad(path, &format!("{field}/mask"), "unreadable"))?;
                    Ok(Column::NullableBool { values, mask })
                }
                "nullable-string-array" => {
                    let values = read_strings(&sub("values")?).ok_or_else(|| bad(path, &format!("{field}/values"), "unreadable"))?;
                    let mask = read_bools(&sub("mask")?).ok_or_else(|| bad(path, &format!("{field}/mask"), "unreadable"))?;
                    Ok(Column::NullableString { values, mask })
                }
                other => Err(bad(path, field, format!("has unsupported column encoding `{other}`"))),
            }
        }
        _ => Err(bad(path, field, "is listed in column-order but missing")),
    }
}
