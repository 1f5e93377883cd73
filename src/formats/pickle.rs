//! Python pickles, read as data: nothing in a pickle is imported or run.
//!
//! The reader knows the opcodes of protocols 0-5 that build str/int/float/bytes/list/tuple/dict
//! values, plus the few globals that rebuild data (numpy scalars, dtypes and arrays,
//! `_codecs.encode`, `collections.OrderedDict`, sets), and refuses every other global unless the
//! caller keeps it as an opaque object (torch's tensors in checkpoints). candle's
//! `candle_core::pickle` reads torch checkpoints (protocol 2) but not protocol 4's
//! SHORT_BINUNICODE/FRAME/MEMOIZE, which `pickle.dump` writes by default.
//!
//! A hostile pickle is small and asks for much: shared references (`x = [x, x]` forty times is
//! about 300 bytes and 2^40 objects once copied out), nesting a million deep (2 MB), or a memo
//! of millions of entries. The reader builds a graph first (shared references stay shared),
//! then copies the result out under a `Budget` (memo entries, nesting depth, objects, bytes,
//! scaled to the file's size), and nothing recurses on the call stack: not the parse, not the
//! copy, not `Drop` of a deep `Py`. Callers name the file in their errors. Used by geneformer's
//! dictionaries, genept's table, uce's protein table, and the scfoundation, scprint and scvi
//! checkpoints (through `formats::torch_zip`).

use std::collections::HashMap;

/// A Python value from a pickle. Dropping one is iterative (see `Drop`), so no nesting can
/// overflow the stack; `read_pickle*` never builds one deeper than `Budget::depth`.
#[derive(Debug, Clone, PartialEq)]
pub enum Py {
    None,
    Bool(bool),
    Int(i64),
    Float(f64),
    Str(String),
    Bytes(Vec<u8>),
    List(Vec<Py>),
    Tuple(Vec<Py>),
    Dict(Vec<(Py, Py)>),
    /// A global that may rebuild data (`module.name`), before it is called.
    Global(String),
    /// A numpy dtype: its type string (`f8`, `<i8`) and whether it is big-endian.
    Dtype(String, bool),
    /// A numpy array: its dtype string (`O8`, `<f4`, `<U5`), shape and elements in C order
    /// (numbers as Int/Float, strings as Str, object arrays' items as they are).
    Array { dtype: String, shape: Vec<usize>, items: Vec<Py> },
    /// An object this reader does not build (only with `PickleOptions::opaque`): the global
    /// named, its call's arguments and its BUILD state, kept as data. A torch tensor's
    /// storage reference (BINPERSID) is kept as an Object named `persistent_id`.
    Object { global: String, args: Vec<Py>, state: Option<Box<Py>> },
}

impl Drop for Py {
    /// Children are moved onto a heap stack and dropped one by one: a list nested a million
    /// deep is freed without a million frames of recursion.
    fn drop(&mut self) {
        fn take_children(v: &mut Py, out: &mut Vec<Py>) {
            match v {
                Py::List(items) | Py::Tuple(items) | Py::Array { items, .. } => out.append(items),
                Py::Dict(pairs) => {
                    for (k, v) in pairs.drain(..) {
                        out.push(k);
                        out.push(v);
                    }
                }
                Py::Object { args, state, .. } => {
                    out.append(args);
                    if let Some(s) = state.take() {
                        out.push(*s);
                    }
                }
                _ => {}
            }
        }
        let mut pending = Vec::new();
        take_children(self, &mut pending);
        while let Some(mut v) = pending.pop() {
            take_children(&mut v, &mut pending);
        }
    }
}

impl Py {
    /// The items of a dict, moved out; any other value is given back.
    pub fn into_dict(mut self) -> std::result::Result<Vec<(Py, Py)>, Py> {
        match &mut self {
            Py::Dict(items) => Ok(std::mem::take(items)),
            _ => Err(self),
        }
    }

    /// The text of a str, moved out; any other value is given back.
    pub fn into_string(mut self) -> std::result::Result<String, Py> {
        match &mut self {
            Py::Str(s) => Ok(std::mem::take(s)),
            _ => Err(self),
        }
    }

    /// The value of `key` in a dict with string keys.
    pub fn get(&self, key: &str) -> Option<&Py> {
        match self {
            Py::Dict(items) => items.iter().find(|(k, _)| matches!(k, Py::Str(s) if s == key)).map(|(_, v)| v),
            _ => None,
        }
    }
}

/// What `read_pickle_with` accepts beyond plain data, and its budgets.
#[derive(Debug, Clone, Copy, Default)]
pub struct PickleOptions<'a> {
    /// Globals (`module.name`, or a prefix ending in `.`) whose calls are kept as opaque
    /// `Py::Object`s instead of refused. Nothing is ever imported or run.
    pub opaque: &'a [&'a str],
    /// Accept persistent ids (torch's tensor storages) as opaque objects.
    pub persistent_ids: bool,
    /// Limits on what the pickle may make the reader build; `None`: `Budget::for_file`.
    pub budget: Option<Budget>,
}

/// Globals whose call builds data and nothing else.
const DATA_GLOBALS: &[&str] = &[
    "numpy.dtype",
    "numpy.core.multiarray.scalar",
    "numpy._core.multiarray.scalar",
    "_codecs.encode",
    "collections.OrderedDict",
    "builtins.set",
    "builtins.frozenset",
    "builtins.dict",
    "builtins.bytes",
    "collections.defaultdict",
    "numpy.core.multiarray._reconstruct",
    "numpy._core.multiarray._reconstruct",
    "numpy.ndarray",
    "numpy.core.numeric._frombuffer",
    "numpy._core.numeric._frombuffer",
];

/// The elements of a numpy array's BUILD state: `data` is a list (object arrays) or the raw
/// bytes of `n` elements of `dtype`.
fn array_items(dtype: &str, big: bool, n: usize, mut data: Py) -> std::result::Result<Vec<Py>, String> {
    let bytes = match &mut data {
        Py::List(v) => return if v.len() == n { Ok(std::mem::take(v)) } else { Err(format!("numpy object array of {n} elements holds {}", v.len())) },
        Py::Bytes(b) => std::mem::take(b),
        Py::Str(s) => s.chars().map(|c| c as u32 as u8).collect(), // protocol 2 latin-1 text
        _ => return Err("numpy array data that is neither bytes nor a list".into()),
    };
    let t = dtype.trim_start_matches(['<', '>', '=', '|']);
    let big = big || dtype.starts_with('>');
    if n == 0 {
        return Ok(vec![]);
    }
    let width = bytes.len() / n;
    if width * n != bytes.len() {
        return Err(format!("numpy {dtype} array of {n} elements with {} bytes", bytes.len()));
    }
    match t.chars().next() {
        Some('U') => bytes
            .chunks(width)
            .map(|c| {
                let s: String = c
                    .chunks(4)
                    .map(|u| {
                        let v: [u8; 4] = u.try_into().unwrap();
                        if big { u32::from_be_bytes(v) } else { u32::from_le_bytes(v) }
                    })
                    .take_while(|&u| u != 0)
                    .map(|u| char::from_u32(u).unwrap_or('\u{fffd}'))
                    .collect();
                Ok(Py::Str(s))
            })
            .collect(),
        Some('S') => Ok(bytes.chunks(width).map(|c| Py::Bytes(c.iter().copied().take_while(|&b| b != 0).collect())).collect()),
        _ => {
            let code = format!("{}{}", &t[..1], width);
            bytes.chunks(width).map(|c| numpy_scalar(&code, big, c)).collect()
        }
    }
}

fn numpy_scalar(dtype: &str, big: bool, bytes: &[u8]) -> std::result::Result<Py, String> {
    let t = dtype.trim_start_matches(['<', '>', '=', '|']);
    let mut b = bytes.to_vec();
    if big || dtype.starts_with('>') {
        b.reverse();
    }
    let arr = |n: usize| -> std::result::Result<Vec<u8>, String> {
        if b.len() != n {
            return Err(format!("numpy {dtype} scalar with {} bytes", b.len()));
        }
        Ok(b.clone())
    };
    Ok(match t {
        "f8" => Py::Float(f64::from_le_bytes(arr(8)?.try_into().unwrap())),
        "f4" => Py::Float(f32::from_le_bytes(arr(4)?.try_into().unwrap()) as f64),
        "i8" => Py::Int(i64::from_le_bytes(arr(8)?.try_into().unwrap())),
        "i4" => Py::Int(i32::from_le_bytes(arr(4)?.try_into().unwrap()) as i64),
        "u4" => Py::Int(u32::from_le_bytes(arr(4)?.try_into().unwrap()) as i64),
        "i2" => Py::Int(i16::from_le_bytes(arr(2)?.try_into().unwrap()) as i64),
        "u2" => Py::Int(u16::from_le_bytes(arr(2)?.try_into().unwrap()) as i64),
        "u8" => Py::Int(u64::from_le_bytes(arr(8)?.try_into().unwrap()) as i64),
        "i1" => Py::Int(i8::from_le_bytes(arr(1)?.try_into().unwrap()) as i64),
        "u1" | "b1" => Py::Int(arr(1)?[0] as i64),
        "f2" => Py::Float(f16_to_f64(u16::from_le_bytes(arr(2)?.try_into().unwrap()))),
        other => return Err(format!("numpy scalar of dtype {other} is not supported")),
    })
}

/// IEEE half precision to f64.
pub fn f16_to_f64(h: u16) -> f64 {
    let sign = if h & 0x8000 != 0 { -1.0 } else { 1.0 };
    let exp = ((h >> 10) & 0x1f) as i32;
    let frac = (h & 0x3ff) as f64;
    sign * match exp {
        0 => frac * 2f64.powi(-24),
        31 => if frac == 0.0 { f64::INFINITY } else { f64::NAN },
        e => (1.0 + frac / 1024.0) * 2f64.powi(e - 15),
    }
}

/// Call a data global with its arguments.
fn call(global: &str, args: Vec<Py>) -> std::result::Result<Py, String> {
    match (global, args.as_slice()) {
        ("numpy.dtype", [Py::Str(t), ..]) => Ok(Py::Dtype(t.clone(), false)),
        ("numpy.core.multiarray.scalar" | "numpy._core.multiarray.scalar", [Py::Dtype(t, big), Py::Bytes(b)]) => numpy_scalar(t, *big, b),
        ("_codecs.encode", [Py::Str(s), Py::Str(enc)]) if enc == "latin1" || enc == "latin-1" => {
            s.chars().map(|c| u8::try_from(c as u32).map_err(|_| "_codecs.encode: a character above 255".to_string())).collect::<std::result::Result<Vec<u8>, String>>().map(Py::Bytes)
        }
        ("collections.OrderedDict", []) => Ok(Py::Dict(vec![])),
        ("collections.OrderedDict", [Py::List(items)]) => items
            .iter()
            .map(|it| match it {
                Py::Tuple(kv) | Py::List(kv) if kv.len() == 2 => Ok((kv[0].clone(), kv[1].clone())),
                _ => Err("OrderedDict item that is not a pair".to_string()),
            })
            .collect::<std::result::Result<Vec<_>, String>>()
            .map(Py::Dict),
        ("collections.defaultdict", _) | ("builtins.dict", []) => Ok(Py::Dict(vec![])),
        ("builtins.bytes", []) => Ok(Py::Bytes(vec![])),
        ("numpy.core.multiarray._reconstruct" | "numpy._core.multiarray._reconstruct", [Py::Global(c), ..]) if c == "numpy.ndarray" => Ok(Py::Array { dtype: String::new(), shape: vec![], items: vec![] }),
        // protocol 5: numpy arrays pickled out of band / via `_frombuffer`
        ("numpy.core.numeric._frombuffer" | "numpy._core.numeric._frombuffer", [Py::Bytes(b), Py::Dtype(t, big), Py::Tuple(shape), Py::Str(order)]) => {
            let shape = array_shape(shape)?;
            if order == "F" && shape.iter().filter(|&&d| d > 1).count() > 1 {
                return Err("Fortran-ordered numpy arrays are not read".into());
            }
            let n = shape.iter().product();
            Ok(Py::Array { dtype: t.clone(), items: array_items(t, *big, n, Py::Bytes(b.clone()))?, shape })
        }
        ("builtins.set" | "builtins.frozenset", []) => Ok(Py::List(vec![])),
        ("builtins.set" | "builtins.frozenset", [Py::List(v)]) => Ok(Py::List(v.clone())),
        (g, a) => Err(format!("unsupported call {g}{a:?}")),
    }
}

fn array_shape(shape: &[Py]) -> std::result::Result<Vec<usize>, String> {
    shape.iter().map(|d| if let Py::Int(n) = d { usize::try_from(*n).map_err(|_| "negative array dimension".to_string()) } else { Err("array shape that is not integers".to_string()) }).collect()
}

fn text_line(b: &[u8], pos: &mut usize) -> std::result::Result<String, String> {
    let rest = &b[*pos..];
    let end = rest.iter().position(|&c| c == b'\n').ok_or("unterminated line")?;
    *pos += end + 1;
    Ok(String::from_utf8_lossy(&rest[..end]).into_owned())
}

/// Limits on what a pickle may make the reader build, so that a small hostile file cannot
/// take the machine's memory or stack. Each refusal names the budget it hit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Budget {
    /// Memo entries (PUT/MEMOIZE); a pickle stores each object at most once.
    pub memo: usize,
    /// Nesting of containers in the result (Python's own pickler stops near 1000).
    pub depth: usize,
    /// Objects built: the reader's own nodes while parsing plus every value materialised.
    pub objects: usize,
    /// Bytes materialised (values at `size_of::<Py>()` each, plus their text and bytes).
    pub bytes: usize,
}

impl Budget {
    /// The budget for a pickle of `len` bytes. Without shared references a pickle builds at
    /// most about one object per byte (numpy elements included), each at most
    /// `size_of::<Py>()` plus its own bytes; shared references (`x = [x, x]`, stored once,
    /// fetched many times) are what can multiply that, and these budgets stop them.
    pub fn for_file(len: usize) -> Budget {
        let py = std::mem::size_of::<Py>();
        Budget {
            memo: (len + 1).min(1 << 26),
            depth: 1000,
            objects: len.saturating_mul(4).saturating_add(1 << 20),
            bytes: len.saturating_mul(2 * py + 2).saturating_add(256 << 20),
        }
    }
}

/// Read a pickle as data. Any opcode or global that is not data is refused, never run.
pub fn read_pickle(b: &[u8]) -> std::result::Result<Py, String> {
    read_pickle_with(b, PickleOptions::default())
}

/// A node of the object graph a pickle builds. Containers hold node ids, so a value stored in
/// the memo and fetched again is shared (as in Python), not copied, until the result is
/// materialised into `Py` under the budget.
#[derive(Debug)]
enum Node {
    Leaf(Py),
    List(Vec<usize>),
    Tuple(Vec<usize>),
    Dict(Vec<(usize, usize)>),
    Object { global: String, args: Vec<usize>, state: Option<usize> },
}

struct Graph {
    nodes: Vec<Node>,
    budget: Budget,
    objects: usize,
    bytes: usize,
}

/// How much one materialised value weighs, its children included (iterative).
fn weight(v: &Py) -> (usize, usize) {
    let (mut objects, mut bytes) = (0usize, 0usize);
    let mut pending = vec![v];
    while let Some(v) = pending.pop() {
        objects += 1;
        bytes += std::mem::size_of::<Py>();
        match v {
            Py::Str(s) | Py::Global(s) | Py::Dtype(s, _) => bytes += s.len(),
            Py::Bytes(b) => bytes += b.len(),
            Py::List(items) | Py::Tuple(items) | Py::Array { items, .. } => pending.extend(items.iter()),
            Py::Dict(pairs) => pending.extend(pairs.iter().flat_map(|(k, v)| [k, v])),
            Py::Object { args, state, .. } => {
                pending.extend(args.iter());
                pending.extend(state.as_deref());
            }
            _ => {}
        }
    }
    (objects, bytes)
}

impl Graph {
    fn over(&self, what: &str, limit: usize) -> String {
        format!("the pickle would build more than {limit} {what} (budget exceeded: a file this size holds no more without shared references; refused before memory runs out)")
    }

    fn add(&mut self, n: Node) -> std::result::Result<usize, String> {
        self.objects += 1;
        if self.objects > self.budget.objects {
            return Err(self.over("objects", self.budget.objects));
        }
        self.nodes.push(n);
        Ok(self.nodes.len() - 1)
    }

    fn leaf(&mut self, v: Py) -> std::result::Result<usize, String> {
        self.add(Node::Leaf(v))
    }

    /// A value made by a data global: containers become nodes (APPEND/SETITEMS may add to them).
    fn intern(&mut self, v: Py) -> std::result::Result<usize, String> {
        let mut v = v;
        let node = match &mut v {
            Py::List(items) => Node::List(std::mem::take(items).into_iter().map(|x| self.leaf(x)).collect::<std::result::Result<_, _>>()?),
            Py::Tuple(items) => Node::Tuple(std::mem::take(items).into_iter().map(|x| self.leaf(x)).collect::<std::result::Result<_, _>>()?),
            Py::Dict(pairs) => Node::Dict(std::mem::take(pairs).into_iter().map(|(k, x)| Ok((self.leaf(k)?, self.leaf(x)?))).collect::<std::result::Result<_, String>>()?),
            _ => return self.leaf(v),
        };
        self.add(node)
    }

    fn charge(&mut self, objects: usize, bytes: usize) -> std::result::Result<(), String> {
        self.objects += objects;
        self.bytes += bytes;
        if self.objects > self.budget.objects {
            return Err(self.over("objects", self.budget.objects));
        }
        if self.bytes > self.budget.bytes {
            return Err(self.over("bytes of values", self.budget.bytes));
        }
        Ok(())
    }

    /// The value of node `root` as a `Py` tree, built without recursion and charged to the
    /// budget: a shared node is copied each time it is reached, so `x = [x, x]` forty times
    /// deep stops at the budget instead of reaching 2^40 objects. With `uses` (the number of
    /// references to each node, over-counted, never under), a leaf that can be reached only one
    /// way (it and every node above it referenced once) is moved out instead of copied.
    fn materialise(&mut self, root: usize, uses: Option<&[u32]>) -> std::result::Result<Py, String> {
        enum Work {
            /// A node, its depth, and whether it is reached through a shared node.
            Visit(usize, usize, bool),
            List(usize),
            Tuple(usize),
            Dict(usize),
            Object(String, usize, bool),
        }
        let mut work = vec![Work::Visit(root, 1, false)];
        let mut out: Vec<Py> = Vec::new();
        while let Some(w) = work.pop() {
            match w {
                Work::Visit(id, depth, shared) => {
                    if depth > self.budget.depth {
                        return Err(format!("the pickle nests containers deeper than {} levels (budget exceeded: nesting depth)", self.budget.depth));
                    }
                    if let Node::Leaf(v) = &self.nodes[id] {
                        let (objects, bytes) = weight(v);
                        self.charge(objects, bytes)?;
                        // referenced once, through nodes referenced once: reached only now
                        let last = !shared && uses.is_some_and(|u| u[id] <= 1);
                        let Node::Leaf(v) = &mut self.nodes[id] else { unreachable!() };
                        out.push(if last { std::mem::replace(v, Py::None) } else { v.clone() });
                        continue;
                    }
                    self.charge(1, std::mem::size_of::<Py>())?;
                    let shared = shared || uses.is_none_or(|u| u[id] > 1);
                    let children = |ids: &mut dyn Iterator<Item = usize>, work: &mut Vec<Work>| {
                        let at = work.len();
                        work.extend(ids.map(|c| Work::Visit(c, depth + 1, shared)));
                        work[at..].reverse();
                    };
                    match &self.nodes[id] {
                        Node::List(ids) => {
                            work.push(Work::List(ids.len()));
                            children(&mut ids.iter().copied(), &mut work);
                        }
                        Node::Tuple(ids) => {
                            work.push(Work::Tuple(ids.len()));
                            children(&mut ids.iter().copied(), &mut work);
                        }
                        Node::Dict(pairs) => {
                            work.push(Work::Dict(pairs.len()));
                            children(&mut pairs.iter().flat_map(|&(k, v)| [k, v]), &mut work);
                        }
                        Node::Object { global, args, state } => {
                            work.push(Work::Object(global.clone(), args.len(), state.is_some()));
                            children(&mut args.iter().copied().chain(*state), &mut work);
                        }
                        Node::Leaf(_) => unreachable!(),
                    }
                }
                Work::List(n) => {
                    let items = out.split_off(out.len() - n);
                    out.push(Py::List(items));
                }
                Work::Tuple(n) => {
                    let items = out.split_off(out.len() - n);
                    out.push(Py::Tuple(items));
                }
                Work::Dict(n) => {
                    let flat = out.split_off(out.len() - 2 * n);
                    let mut it = flat.into_iter();
                    let mut pairs = Vec::with_capacity(n);
                    while let (Some(k), Some(v)) = (it.next(), it.next()) {
                        pairs.push((k, v));
                    }
                    out.push(Py::Dict(pairs));
                }
                Work::Object(global, n, has_state) => {
                    let state = if has_state { out.pop().map(Box::new) } else { None };
                    let args = out.split_off(out.len() - n);
                    out.push(Py::Object { global, args, state });
                }
            }
        }
        out.pop().ok_or_else(|| "empty pickle".to_string())
    }

    fn leaf_ref(&self, id: usize) -> Option<&Py> {
        match &self.nodes[id] {
            Node::Leaf(v) => Some(v),
            _ => None,
        }
    }
}

/// Read a pickle as data, keeping the calls of `o.opaque` globals (and, with
/// `o.persistent_ids`, torch's storage references) as `Py::Object`s. Nothing is run.
///
/// The pickle builds a graph of nodes first (the memo holds references, as in Python, so an
/// object stored and then filled is seen filled); the result is then materialised under the
/// budget (`o.budget`, else `Budget::for_file(b.len())`): memo entries, nesting depth, objects
/// and bytes. Nothing on the way recurses on the call stack.
pub fn read_pickle_with(b: &[u8], o: PickleOptions) -> std::result::Result<Py, String> {
    let budget = o.budget.unwrap_or_else(|| Budget::for_file(b.len()));
    let mut g = Graph { nodes: Vec::new(), budget, objects: 0, bytes: 0 };
    let mut stack: Vec<usize> = Vec::new();
    // stack lengths at each MARK
    let mut marks: Vec<usize> = Vec::new();
    let mut memo: HashMap<u64, usize> = HashMap::new();
    let is_opaque = |g: &str| o.opaque.iter().any(|p| if p.ends_with('.') { g.starts_with(p) } else { g == *p });
    let mut pos = 0usize;
    let take = |pos: &mut usize, n: usize| -> std::result::Result<&[u8], String> {
        if n > b.len() || *pos > b.len() - n {
            return Err("truncated pickle".into());
        }
        let s = &b[*pos..*pos + n];
        *pos += n;
        Ok(s)
    };
    let u32le = |s: &[u8]| u32::from_le_bytes(s.try_into().unwrap()) as usize;
    let pop = |stack: &mut Vec<usize>, marks: &[usize]| -> std::result::Result<usize, String> {
        if marks.last().is_some_and(|&m| m >= stack.len()) {
            return Err("pickle pops past its MARK".into());
        }
        stack.pop().ok_or_else(|| "pickle stack underflow".to_string())
    };
    let pop_mark = |stack: &mut Vec<usize>, marks: &mut Vec<usize>| -> std::result::Result<Vec<usize>, String> {
        let m = marks.pop().ok_or("no MARK on the pickle stack")?;
        Ok(stack.split_off(m.min(stack.len())))
    };
    let pairs = |items: Vec<usize>| -> std::result::Result<Vec<(usize, usize)>, String> {
        if items.len() % 2 != 0 {
            return Err("odd number of items for a dict".into());
        }
        Ok(items.chunks(2).map(|kv| (kv[0], kv[1])).collect())
    };
    loop {
        let op = *take(&mut pos, 1)?.first().unwrap();
        match op {
            0x80 => {
                take(&mut pos, 1)?;
            } // PROTO
            0x95 => {
                take(&mut pos, 8)?;
            } // FRAME
            b'.' => {
                let root = pop(&mut stack, &marks)?;
                // references to each node, for moving leaves out on their last use
                let mut uses = vec![0u32; g.nodes.len()];
                uses[root] += 1;
                for n in &g.nodes {
                    let mut add = |i: usize| uses[i] = uses[i].saturating_add(1);
                    match n {
                        Node::Leaf(_) => {}
                        Node::List(ids) | Node::Tuple(ids) => ids.iter().for_each(|&i| add(i)),
                        Node::Dict(p) => p.iter().for_each(|&(k, v)| {
                            add(k);
                            add(v)
                        }),
                        Node::Object { args, state, .. } => args.iter().chain(state.iter()).for_each(|&i| add(i)),
                    }
                }
                return g.materialise(root, Some(&uses));
            }
            b'(' => marks.push(stack.len()),
            b'0' => {
                // as pickle.py: POP on an empty frame pops the MARK itself
                if marks.last() == Some(&stack.len()) {
                    marks.pop();
                } else {
                    pop(&mut stack, &marks)?;
                }
            }
            b'1' => {
                pop_mark(&mut stack, &mut marks)?;
            }
            b'2' => {
                let v = *stack.last().ok_or("DUP on an empty stack")?;
                stack.push(v)
            }
            b'N' => stack.push(g.leaf(Py::None)?),
            0x88 => stack.push(g.leaf(Py::Bool(true))?),
            0x89 => stack.push(g.leaf(Py::Bool(false))?),
            b'J' => stack.push(g.leaf(Py::Int(i32::from_le_bytes(take(&mut pos, 4)?.try_into().unwrap()) as i64))?),
            b'K' => stack.push(g.leaf(Py::Int(take(&mut pos, 1)?[0] as i64))?),
            b'M' => stack.push(g.leaf(Py::Int(u16::from_le_bytes(take(&mut pos, 2)?.try_into().unwrap()) as i64))?),
            0x8a | 0x8b => {
                let n = if op == 0x8a { take(&mut pos, 1)?[0] as usize } else { u32le(take(&mut pos, 4)?) };
                let s = take(&mut pos, n)?;
                if n > 8 {
                    return Err(format!("integer of {n} bytes"));
                }
                let mut v: i64 = 0;
                for (i, &byte) in s.iter().enumerate() {
                    v |= (byte as i64) << (8 * i);
                }
                if n > 0 && n < 8 && s[n - 1] & 0x80 != 0 {
                    v -= 1i64 << (8 * n);
                }
                stack.push(g.leaf(Py::Int(v))?)
            }
            b'I' | b'L' => {
                let t = text_line(b, &mut pos)?;
                let t = t.trim_end_matches('L');
                let v = match t {
                    "01" => Py::Bool(true),
                    "00" => Py::Bool(false),
                    _ => Py::Int(t.parse().map_err(|_| format!("bad INT {t:?}"))?),
                };
                stack.push(g.leaf(v)?)
            }
            b'G' => stack.push(g.leaf(Py::Float(f64::from_be_bytes(take(&mut pos, 8)?.try_into().unwrap())))?),
            b'F' => {
                let t = text_line(b, &mut pos)?;
                stack.push(g.leaf(Py::Float(t.parse().map_err(|_| format!("bad FLOAT {t:?}"))?))?)
            }
            b'X' | 0x8c | 0x8d | b'T' | b'U' => {
                let n = match op {
                    0x8c | b'U' => take(&mut pos, 1)?[0] as usize,
                    0x8d => usize::try_from(u64::from_le_bytes(take(&mut pos, 8)?.try_into().unwrap())).unwrap_or(usize::MAX),
                    _ => u32le(take(&mut pos, 4)?),
                };
                let s = take(&mut pos, n)?;
                // BINSTRING/SHORT_BINSTRING are Python 2 byte strings; read them as latin-1 text
                let v = if op == b'T' || op == b'U' { s.iter().map(|&c| c as char).collect() } else { String::from_utf8(s.to_vec()).map_err(|e| e.to_string())? };
                stack.push(g.leaf(Py::Str(v))?)
            }
            b'V' => {
                let t = text_line(b, &mut pos)?;
                stack.push(g.leaf(Py::Str(t))?)
            }
            b'C' | b'B' | 0x8e | 0x96 => {
                let n = match op {
                    b'C' => take(&mut pos, 1)?[0] as usize,
                    b'B' => u32le(take(&mut pos, 4)?),
                    _ => usize::try_from(u64::from_le_bytes(take(&mut pos, 8)?.try_into().unwrap())).unwrap_or(usize::MAX),
                };
                let v = Py::Bytes(take(&mut pos, n)?.to_vec());
                stack.push(g.leaf(v)?)
            }
            b')' => stack.push(g.add(Node::Tuple(vec![]))?),
            b't' => {
                let items = pop_mark(&mut stack, &mut marks)?;
                stack.push(g.add(Node::Tuple(items))?)
            }
            0x85..=0x87 => {
                let n = (op - 0x84) as usize;
                if stack.len() < n + marks.last().copied().unwrap_or(0) {
                    return Err("pickle stack underflow".into());
                }
                let items = stack.split_off(stack.len() - n);
                stack.push(g.add(Node::Tuple(items))?)
            }
            b']' | 0x8f => stack.push(g.add(Node::List(vec![]))?), // EMPTY_LIST, EMPTY_SET
            b'l' | 0x91 => {
                let items = pop_mark(&mut stack, &mut marks)?;
                stack.push(g.add(Node::List(items))?)
            }
            b'a' | b'e' | 0x90 => {
                let items = if op == b'a' { vec![pop(&mut stack, &marks)?] } else { pop_mark(&mut stack, &mut marks)? };
                let top = *stack.last().ok_or("APPEND on an empty stack")?;
                match &mut g.nodes[top] {
                    Node::List(v) => v.extend(items),
                    _ => return Err("APPEND to something that is not a list".into()),
                }
            }
            b'}' => stack.push(g.add(Node::Dict(vec![]))?),
            b'd' => {
                let items = pop_mark(&mut stack, &mut marks)?;
                let d = pairs(items)?;
                stack.push(g.add(Node::Dict(d))?)
            }
            b's' | b'u' => {
                let items = if op == b's' {
                    let v = pop(&mut stack, &marks)?;
                    let k = pop(&mut stack, &marks)?;
                    vec![k, v]
                } else {
                    pop_mark(&mut stack, &mut marks)?
                };
                let top = *stack.last().ok_or("SETITEM on an empty stack")?;
                let items = pairs(items)?;
                match &mut g.nodes[top] {
                    Node::Dict(d) => d.extend(items),
                    _ => return Err("SETITEM on something that is not a dict".into()),
                }
            }
            b'q' | b'r' | 0x94 | b'p' => {
                let key = match op {
                    b'q' => take(&mut pos, 1)?[0] as u64,
                    b'r' => u32le(take(&mut pos, 4)?) as u64,
                    b'p' => text_line(b, &mut pos)?.parse().map_err(|_| "bad PUT")?,
                    _ => memo.len() as u64,
                };
                let v = *stack.last().ok_or("PUT on an empty stack")?;
                memo.insert(key, v);
                if memo.len() > budget.memo {
                    return Err(format!("the pickle stores more than {} memo entries (budget exceeded: memo size)", budget.memo));
                }
            }
            b'h' | b'j' | b'g' => {
                let key = match op {
                    b'h' => take(&mut pos, 1)?[0] as u64,
                    b'j' => u32le(take(&mut pos, 4)?) as u64,
                    _ => text_line(b, &mut pos)?.parse().map_err(|_| "bad GET")?,
                };
                stack.push(*memo.get(&key).ok_or_else(|| format!("memo {key} not set"))?)
            }
            b'c' | 0x93 => {
                let (module, name) = if op == b'c' {
                    (text_line(b, &mut pos)?, text_line(b, &mut pos)?)
                } else {
                    let n = pop(&mut stack, &marks)?;
                    let m = pop(&mut stack, &marks)?;
                    match (g.leaf_ref(m), g.leaf_ref(n)) {
                        (Some(Py::Str(m)), Some(Py::Str(n))) => (m.clone(), n.clone()),
                        _ => return Err("STACK_GLOBAL without two strings".into()),
                    }
                };
                let module = if module == "__builtin__" { "builtins".to_string() } else { module };
                let name = format!("{module}.{name}");
                if !DATA_GLOBALS.contains(&name.as_str()) && !is_opaque(&name) {
                    return Err(format!("the pickle refers to {name}, which is code, not data; only plain dicts of strings and numbers are read"));
                }
                stack.push(g.leaf(Py::Global(name))?)
            }
            b'Q' if o.persistent_ids => {
                let pid = pop(&mut stack, &marks)?;
                stack.push(g.add(Node::Object { global: "persistent_id".into(), args: vec![pid], state: None })?)
            }
            b'R' | 0x81 => {
                let args = pop(&mut stack, &marks)?;
                let f = pop(&mut stack, &marks)?;
                let (Some(Py::Global(name)), Node::Tuple(arg_ids)) = (g.leaf_ref(f), &g.nodes[args]) else {
                    return Err("REDUCE without a global and a tuple".into());
                };
                let (name, arg_ids) = (name.clone(), arg_ids.clone());
                if is_opaque(&name) && !DATA_GLOBALS.contains(&name.as_str()) {
                    stack.push(g.add(Node::Object { global: name, args: arg_ids, state: None })?)
                } else {
                    let args = arg_ids.iter().map(|&a| g.materialise(a, None)).collect::<std::result::Result<Vec<Py>, String>>()?;
                    let v = call(&name, args)?;
                    stack.push(g.intern(v)?)
                }
            }
            b'b' => {
                // BUILD: a numpy dtype's or array's state; an opaque object keeps its state
                let state = pop(&mut stack, &marks)?;
                let top = *stack.last().ok_or("BUILD on an empty stack")?;
                match &g.nodes[top] {
                    Node::Object { .. } => {
                        if let Node::Object { state: st, .. } = &mut g.nodes[top] {
                            *st = Some(state);
                        }
                    }
                    // a dict subclass's instance attributes (an OrderedDict state_dict's
                    // `_metadata`): not part of its items, dropped
                    Node::Dict(_) => {}
                    Node::Leaf(Py::Dtype(..) | Py::Array { .. }) => {
                        let s = g.materialise(state, None)?;
                        let Node::Leaf(target) = &mut g.nodes[top] else { unreachable!() };
                        build(target, s)?;
                        let (objects, bytes) = weight(target);
                        g.charge(objects, bytes)?;
                    }
                    _ => return Err("BUILD of an object that is not a numpy dtype or array".into()),
                }
            }
            other => return Err(format!("pickle opcode 0x{other:02x} is not supported (only data is read)")),
        }
    }
}

/// BUILD of a numpy dtype (byte order) or array (shape, dtype, data) from its state.
fn build(target: &mut Py, mut state: Py) -> std::result::Result<(), String> {
    match (target, &mut state) {
        (Py::Dtype(_, big), Py::Tuple(s)) => {
            if let Some(Py::Str(order)) = s.get(1) {
                *big = order == ">";
            }
            Ok(())
        }
        (Py::Array { dtype, shape, items }, Py::Tuple(s)) if s.len() == 5 => {
            // (version, shape, dtype, is_fortran, data)
            let Py::Tuple(dims) = &s[1] else { return Err("numpy array state without a shape".into()) };
            let dims = array_shape(dims)?;
            let Py::Dtype(t, big) = &s[2] else { return Err("numpy array state without a dtype".into()) };
            let (t, big) = (t.clone(), *big);
            if s[3] == Py::Bool(true) && dims.len() > 1 {
                return Err("Fortran-ordered numpy arrays are not read".into());
            }
            let n = dims.iter().try_fold(1usize, |a, &d| a.checked_mul(d)).ok_or("numpy array with more elements than memory can address")?;
            *items = array_items(&t, big, n, std::mem::replace(&mut s[4], Py::None))?;
            *dtype = t;
            *shape = dims;
            Ok(())
        }
        _ => Err("BUILD of a numpy dtype or array with a state it does not take".into()),
    }
}

/// Small hostile pickles, for the tests of the budgets (here and in tests/it).
pub mod hostile {
    /// `x = []; for _ in range(levels): x = [x, x]; {'k': x}` as protocol 2 opcodes, laid out as
    /// Python's pickler writes it (each list stored in the memo once, then fetched again):
    /// 338 bytes for 40 levels (301 in protocol 4's shorter opcodes). At most 199 levels.
    pub fn shared_reference_bomb(levels: u8) -> Vec<u8> {
        assert!(levels < 200);
        let mut b = b"\x80\x02}q\xc8X\x01\x00\x00\x00kq\xc9".to_vec();
        // x_k = EMPTY_LIST, PUT k, MARK, x_(k-1), GET k-1, APPENDS
        for k in (1..=levels).rev() {
            b.extend_from_slice(&[b']', b'q', k, b'(']);
        }
        b.extend_from_slice(b"]q\x00");
        for k in 1..=levels {
            b.extend_from_slice(&[b'h', k - 1, b'e']);
        }
        b.extend_from_slice(b"s.");
        b
    }

    /// A list nested `n` deep: EMPTY_LIST n times, then APPEND n-1 times.
    pub fn nested_lists(n: usize) -> Vec<u8> {
        let mut b = b"\x80\x02".to_vec();
        b.extend(std::iter::repeat_n(b']', n));
        b.extend(std::iter::repeat_n(b'a', n - 1));
        b.push(b'.');
        b
    }
}

#[cfg(test)]
mod tests {
    use super::hostile::{nested_lists, shared_reference_bomb};
    use super::*;

    #[test]
    fn pickles_are_read_as_data() {
        // pickle.dumps({'ENSG1': 2, '<pad>': 0, 'a': 1.5, 'b': -3, 'c': 70000}, protocol=4)
        let p4: &[u8] = b"\x80\x04\x95=\x00\x00\x00\x00\x00\x00\x00}\x94(\x8c\x05ENSG1\x94K\x02\x8c\x05<pad>\x94K\x00\x8c\x01a\x94G?\xf8\x00\x00\x00\x00\x00\x00\x8c\x01b\x94J\xfd\xff\xff\xff\x8c\x01c\x94Jp\x11\x01\x00u.";
        let v = read_pickle(p4).unwrap();
        assert_eq!(
            v,
            Py::Dict(vec![
                (Py::Str("ENSG1".into()), Py::Int(2)),
                (Py::Str("<pad>".into()), Py::Int(0)),
                (Py::Str("a".into()), Py::Float(1.5)),
                (Py::Str("b".into()), Py::Int(-3)),
                (Py::Str("c".into()), Py::Int(70000)),
            ])
        );
        // pickle.dumps({'x': 1}, protocol=2)
        let p2: &[u8] = b"\x80\x02}q\x00X\x01\x00\x00\x00xq\x01K\x01s.";
        assert_eq!(read_pickle(p2).unwrap(), Py::Dict(vec![(Py::Str("x".into()), Py::Int(1))]));
        // code is refused: pickle.dumps(os.system) -> posix.system
        let evil: &[u8] = b"\x80\x04\x95\x14\x00\x00\x00\x00\x00\x00\x00\x8c\x05posix\x94\x8c\x06system\x94\x93\x94.";
        let e = read_pickle(evil).unwrap_err();
        assert!(e.contains("posix.system"), "{e}");
    }

    #[test]
    fn numpy_scalars_decode() {
        assert_eq!(numpy_scalar("f8", false, &2.5f64.to_le_bytes()).unwrap(), Py::Float(2.5));
        assert_eq!(numpy_scalar("<i8", false, &(-7i64).to_le_bytes()).unwrap(), Py::Int(-7));
        assert_eq!(numpy_scalar("f4", true, &1.5f32.to_be_bytes()).unwrap(), Py::Float(1.5));
    }

    #[test]
    fn numpy_arrays_defaultdicts_and_shared_references() {
        // scripts: a defaultdict(dict) holding an object array, a float32 array and a <U2
        // array; a dict referenced twice (the second time through the memo); an int64 array.
        // Written by pickle.dumps(..., protocol=2) and protocol=4.
        let p2 = include_bytes!("../../tests/fixtures/scvi_pretrained/arrays_p2.pkl");
        let p4 = include_bytes!("../../tests/fixtures/scvi_pretrained/arrays_p4.pkl");
        for b in [&p2[..], &p4[..]] {
            let v = read_pickle(b).unwrap();
            let batch = v.get("reg").and_then(|r| r.get("batch")).unwrap();
            let arr = |k: &str| match batch.get(k) {
                Some(Py::Array { items, shape, .. }) => (items.clone(), shape.clone()),
                other => panic!("{k}: {other:?}"),
            };
            assert_eq!(arr("categorical_mapping"), (vec![Py::Str("HES4".into()), Py::Str("CD3E".into())], vec![2]));
            assert_eq!(arr("n"), (vec![Py::Float(1.5), Py::Float(-2.0)], vec![2]));
            assert_eq!(arr("u"), (vec![Py::Str("ab".into()), Py::Str("c".into())], vec![2]));
            // the shared dict is seen filled both times
            assert_eq!(v.get("s1"), Some(&Py::Dict(vec![(Py::Str("k".into()), Py::Int(1))])));
            assert_eq!(v.get("s2"), v.get("s1"));
            assert!(matches!(v.get("i"), Some(Py::Array { items, .. }) if *items == vec![Py::Int(0), Py::Int(1), Py::Int(2)]));
        }
    }

    #[test]
    fn opaque_globals_are_kept_not_run() {
        // torch-style: GLOBAL torch._utils._rebuild_tensor_v2, a persistent id, REDUCE
        let b: &[u8] = b"\x80\x02ctorch._utils\n_rebuild_tensor_v2\nq\x00X\x01\x00\x00\x000Q\x85R.";
        assert!(read_pickle(b).unwrap_err().contains("torch._utils._rebuild_tensor_v2"));
        let o = PickleOptions { opaque: &["torch."], persistent_ids: false, ..Default::default() };
        assert!(read_pickle_with(b, o).unwrap_err().contains("0x51"), "persistent ids are refused unless asked for");
        let o = PickleOptions { opaque: &["torch."], persistent_ids: true, ..Default::default() };
        match &read_pickle_with(b, o).unwrap() {
            Py::Object { global, args, .. } => {
                assert_eq!(global, "torch._utils._rebuild_tensor_v2");
                assert!(matches!(&args[0], Py::Object { global, .. } if global == "persistent_id"));
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn shared_references_stay_shared_until_the_budget() {
        // a few levels: read, and every copy is there
        let v = read_pickle(&shared_reference_bomb(3)).unwrap();
        let (objects, _) = weight(v.get("k").unwrap());
        assert_eq!(objects, 15, "2^4 - 1 lists");
        // forty levels: 2^41 objects once copied; refused by the object budget, quickly
        let bomb = shared_reference_bomb(40);
        assert!(bomb.len() < 400, "{}", bomb.len());
        let t = std::time::Instant::now();
        let e = read_pickle(&bomb).unwrap_err();
        assert!(e.contains("budget exceeded") && e.contains("objects"), "{e}");
        assert!(t.elapsed().as_secs() < 5, "{:?}", t.elapsed());
    }

    #[test]
    fn nesting_is_bounded_without_recursion() {
        // a million levels: refused at the depth budget, and no stack overflow on the way
        let e = read_pickle(&nested_lists(1_000_000)).unwrap_err();
        assert!(e.contains("deeper than 1000 levels") && e.contains("nesting depth"), "{e}");
        // within the budget it reads
        let v = read_pickle(&nested_lists(900)).unwrap();
        let (mut at, mut depth) = (&v, 1);
        while let Py::List(items) = at {
            let Some(inner) = items.first() else { break };
            at = inner;
            depth += 1;
        }
        assert_eq!(depth, 900);
    }

    #[test]
    fn dropping_a_deep_value_does_not_recurse() {
        let mut v = Py::List(vec![]);
        for _ in 0..2_000_000 {
            v = Py::List(vec![v]);
        }
        drop(v);
        let mut d = Py::None;
        for i in 0..1_000_000 {
            d = Py::Object { global: "g".into(), args: vec![Py::Dict(vec![(Py::Int(i), d)])], state: None };
        }
        drop(d);
    }

    #[test]
    fn memo_objects_and_bytes_have_budgets() {
        let with = |budget: Budget| PickleOptions { budget: Some(budget), ..Default::default() };
        let big = Budget { memo: 1 << 20, depth: 1000, objects: 1 << 20, bytes: 1 << 30 };
        // three memo entries against a budget of two
        let e = read_pickle_with(b"\x80\x02(]q\x00]q\x01]q\x02l.", with(Budget { memo: 2, ..big })).unwrap_err();
        assert!(e.contains("more than 2 memo entries") && e.contains("memo size"), "{e}");
        // objects: a list of 100 ints against a budget of 50
        let mut many = b"\x80\x02](".to_vec();
        for _ in 0..100 {
            many.extend_from_slice(b"K\x01");
        }
        many.extend_from_slice(b"e.");
        assert!(read_pickle_with(&many, with(big)).is_ok());
        let e = read_pickle_with(&many, with(Budget { objects: 50, ..big })).unwrap_err();
        assert!(e.contains("more than 50 objects"), "{e}");
        // bytes: one 1000-byte string referenced 100 times
        let mut s = b"\x80\x02X\xe8\x03\x00\x00".to_vec();
        s.extend(std::iter::repeat_n(b'x', 1000));
        s.extend_from_slice(b"q\x00](");
        for _ in 0..100 {
            s.extend_from_slice(b"h\x00");
        }
        s.extend_from_slice(b"e.");
        assert_eq!(read_pickle_with(&s, with(big)).unwrap(), Py::List(vec![Py::Str("x".repeat(1000)); 100]));
        let e = read_pickle_with(&s, with(Budget { bytes: 50_000, ..big })).unwrap_err();
        assert!(e.contains("more than 50000 bytes"), "{e}");
        // the default budget scales with the file
        let small = Budget::for_file(300);
        assert!(small.objects >= 1 << 20 && small.depth == 1000 && small.memo == 301);
    }
}
