//! AnnData dataframes (`obs`, `var`, `raw/var`): index plus typed columns.

use std::path::Path;

use hdf5::{Dataset, Group};

use super::h5util::{check_backed, encoding_type, is_bool, is_string, read_bools, read_strings, str_array_attr, str_attr};
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
    /// Values as labels (categorical, string or integer columns): `None` for missing values. A
    /// numeric column is labels when every value is a whole number (NaN is missing), as pandas
    /// stores an int64 column or an integer column that held NaN.
    pub fn as_labels(&self) -> Option<Vec<Option<String>>> {
        match self {
            Column::Numeric(v) => {
                if v.iter().all(|x| x.is_nan() || (x.is_finite() && x.fract() == 0.0)) {
                    Some(v.iter().map(|&x| if x.is_nan() { None } else { Some(format!("{}", x as i64)) }).collect())
                } else {
                    None
                }
            }
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
///
/// The index is a `string-array` (anndata < 0.13, or pandas < 3), a `nullable-string-array`
/// group (anndata 0.13 with pandas 3: `values` + `mask`), a `categorical`, or numbers. An index
/// with missing values is refused, naming the rows.
pub fn read_index(path: &Path, g: &Group, field: &str) -> Result<Vec<String>> {
    let index_name = str_attr(g, "_index").unwrap_or_else(|| "_index".into());
    let f = format!("{field}/{index_name}");
    let missing = || bad(path, &f, "is missing (every AnnData dataframe has an index)");
    match g.loc_type_by_name(&index_name) {
        Ok(hdf5::LocationType::Dataset) => {}
        Ok(hdf5::LocationType::Group) => {
            let col = read_column(path, g, &index_name, &f)?;
            return index_from_column(path, &f, col);
        }
        _ => return Err(missing()),
    }
    let ds = g.dataset(&index_name).map_err(|_| missing())?;
    if is_string(&ds) {
        check_backed(path, &f, &ds)?;
        read_strings(&ds).ok_or_else(|| bad(path, &f, "cannot be read as strings"))
    } else {
        // numeric index: turn into strings as pandas would show them
        check_backed(path, &f, &ds)?;
        let v: Vec<i64> = ds.read_raw().map_err(|e| bad(path, &f, format!("cannot be read: {e}")))?;
        Ok(v.into_iter().map(|x| x.to_string()).collect())
    }
}

/// An index read through the column readers (nullable strings, categorical): every value present.
fn index_from_column(path: &Path, field: &str, col: Column) -> Result<Vec<String>> {
    let labels = col.as_labels().ok_or_else(|| bad(path, field, format!("is a {} column; an index holds strings", col.kind())))?;
    let missing: Vec<usize> = labels.iter().enumerate().filter(|(_, l)| l.is_none()).map(|(i, _)| i).collect();
    if !missing.is_empty() {
        return Err(Error::BadField {
            path: path.into(),
            field: field.into(),
            detail: format!("has {} missing value(s), at row(s) {}", missing.len(), row_list(&missing)),
            hint: Some("every cell and gene needs a name: fill them in anndata (e.g. `adata.obs_names = adata.obs_names.fillna('cell')` then `adata.obs_names_make_unique()`) and write the file again".into()),
        });
    }
    Ok(labels.into_iter().map(Option::unwrap_or_default).collect())
}

/// Row numbers for a message: the first ten, then how many more.
pub fn row_list(rows: &[usize]) -> String {
    let head: Vec<String> = rows.iter().take(10).map(|r| r.to_string()).collect();
    if rows.len() > 10 {
        format!("{} and {} more", head.join(", "), rows.len() - 10)
    } else {
        head.join(", ")
    }
}

/// Read a whole dataframe group.
pub fn read_dataframe(path: &Path, g: &Group, field: &str) -> Result<DataFrame> {
    read_dataframe_columns(path, g, field, None)
}

/// The names of a dataframe group's columns, in order (`column-order`), none of them read.
pub fn column_names(g: &Group) -> Vec<String> {
    str_array_attr(g, "column-order").unwrap_or_default()
}

/// Read a dataframe group's index and the columns named in `only` (all of them with `None`).
/// A named column the group lacks is left out (the caller says what is missing); the others
/// are never opened, so a column in an encoding scfoundry does not read costs nothing.
pub fn read_dataframe_columns(path: &Path, g: &Group, field: &str, only: Option<&[&str]>) -> Result<DataFrame> {
    let index_name = str_attr(g, "_index").unwrap_or_else(|| "_index".into());
    let index = read_index(path, g, field)?;
    let order = column_names(g);
    let mut columns = Vec::with_capacity(order.len());
    for name in order.into_iter().filter(|n| only.is_none_or(|o| o.contains(&n.as_str()))) {
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
    check_backed(path, field, ds)?;
    if is_bool(ds) {
        return read_bools(ds).map(Column::Bool).ok_or_else(|| bad(path, field, "cannot be read as booleans"));
    }
    if is_string(ds) {
        return read_strings(ds).map(Column::Strings).ok_or_else(|| bad(path, field, "cannot be read as strings"));
    }
    ds.read_raw::<f64>().map(Column::Numeric).map_err(|e| bad(path, field, format!("cannot be read: {e}")))
}

/// Read one column (a dataset or an encoded group) of a dataframe group, or of any group that
/// holds such an element (uns).
pub(crate) fn read_column(path: &Path, g: &Group, name: &str, field: &str) -> Result<Column> {
    match g.loc_type_by_name(name) {
        Ok(hdf5::LocationType::Dataset) => {
            let ds = g.dataset(name).map_err(|e| bad(path, field, format!("cannot be opened: {e}")))?;
            // anndata 0.7 (dataframe 0.1.0): a categorical is its codes, with a `categories`
            // attribute referring to `__categories/<name>`.
            if ds.attr("categories").is_ok() {
                let cats = g.dataset(&format!("__categories/{name}")).map_err(|_| bad(path, &format!("{field}.attrs['categories']"), "points to nothing (expected __categories/<column>, as anndata 0.7 writes)"))?;
                let codes: Vec<i64> = {
                    check_backed(path, field, &ds)?;
                    ds.read_raw().map_err(|e| bad(path, field, format!("cannot be read: {e}")))?
                };
                let ordered = bool_attr(&ds, "ordered");
                return categorical(path, field, codes, &cats, ordered);
            }
            read_numeric(path, &ds, field)
        }
        Ok(hdf5::LocationType::Group) => {
            let cg = g.group(name).map_err(|e| bad(path, field, format!("cannot be opened: {e}")))?;
            let enc = encoding_type(&cg).unwrap_or_default();
            let sub = |n: &str| cg.dataset(n).map_err(|_| bad(path, &format!("{field}/{n}"), "is missing"));
            match enc.as_str() {
                "categorical" => {
                    let codes_ds = sub("codes")?;
                    check_backed(path, &format!("{field}/codes"), &codes_ds)?;
                    let codes: Vec<i64> = codes_ds.read_raw().map_err(|e| bad(path, &format!("{field}/codes"), format!("{e}")))?;
                    let ordered = bool_attr(&cg, "ordered");
                    categorical(path, field, codes, &sub("categories")?, ordered)
                }
                "nullable-integer" => {
                    let values_ds = sub("values")?;
                    check_backed(path, &format!("{field}/values"), &values_ds)?;
                    let values: Vec<i64> = values_ds.read_raw().map_err(|e| bad(path, field, format!("{e}")))?;
                    let mask = read_bools(&sub("mask")?).ok_or_else(|| bad(path, &format!("{field}/mask"), "unreadable"))?;
                    Ok(Column::NullableInt { values, mask })
                }
                "nullable-boolean" => {
                    let values = read_bools(&sub("values")?).ok_or_else(|| bad(path, &format!("{field}/values"), "unreadable"))?;
                    let mask = read_bools(&sub("mask")?).ok_or_else(|| bad(path, &format!("{field}/mask"), "unreadable"))?;
                    Ok(Column::NullableBool { values, mask })
                }
                "nullable-string-array" => {
                    let values_ds = sub("values")?;
                    check_backed(path, &format!("{field}/values"), &values_ds)?;
                    let values = read_strings(&values_ds).ok_or_else(|| bad(path, &format!("{field}/values"), "unreadable"))?;
                    let mask = read_bools(&sub("mask")?).ok_or_else(|| bad(path, &format!("{field}/mask"), "unreadable"))?;
                    Ok(Column::NullableString { values, mask })
                }
                other => Err(Error::BadField {
                    path: path.into(),
                    field: field.into(),
                    detail: format!("has the column encoding `{other}`, which scfoundry does not read"),
                    hint: Some("the encodings read are listed in docs/file-formats.md; drop or convert this column in anndata (e.g. `del adata.obs[...]`) and write the file again".into()),
                }),
            }
        }
        _ => Err(bad(path, field, "is listed in column-order but missing")),
    }
}

/// A boolean attribute (`ordered`), stored as a bool or an integer.
fn bool_attr(loc: &hdf5::Location, name: &str) -> bool {
    loc.attr(name)
        .ok()
        .and_then(|a| a.read_scalar::<bool>().ok().or_else(|| a.read_scalar::<i8>().ok().map(|x| x != 0)))
        .unwrap_or(false)
}

/// A categorical column from its codes and its categories (strings, as anndata's `string-array`,
/// or numbers).
fn categorical(path: &Path, field: &str, codes: Vec<i64>, cats_ds: &Dataset, ordered: bool) -> Result<Column> {
    let cf = format!("{field}/categories");
    check_backed(path, &cf, cats_ds)?;
    let categories = if is_string(cats_ds) {
        read_strings(cats_ds).ok_or_else(|| bad(path, &cf, "unreadable"))?
    } else {
        let v: Vec<f64> = cats_ds.read_raw().map_err(|e| bad(path, &cf, format!("{e}")))?;
        v.into_iter().map(|x| if x.fract() == 0.0 { format!("{}", x as i64) } else { x.to_string() }).collect()
    };
    if let Some(&bad_code) = codes.iter().find(|&&c| c >= categories.len() as i64 || c < -1) {
        return Err(bad(path, &format!("{field}/codes"), format!("holds code {bad_code} but there are {} categories", categories.len())));
    }
    Ok(Column::Categorical { codes, categories, ordered })
}
