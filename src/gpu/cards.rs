//! Several cards on one node: `--gpu` lists (`0`, `0,1,2,3`, `0-3`, `all`, `0,0`) and the
//! task-side lock that gives each task one card.
//!
//! A task process takes its card itself, before its first CUDA call: it lists the node's cards
//! from the driver (`nvidia-smi`, else /proc/driver/nvidia; never through CUDA, which would
//! fix the visible devices before we choose), takes an exclusive `flock` on a lock file named
//! by the card's UUID in a node-local folder, and sets `CUDA_VISIBLE_DEVICES` to that UUID.
//! When every card of its list is held it waits, saying so once on stderr. The lock belongs to
//! the open file, so it goes with the process however it ends (exit, crash, kill -9).
//!
//! Locks are keyed by UUID rather than by ordinal because ordinals are not stable: inside a
//! Docker container given `--gpus device=2,3` those cards are 0 and 1, and CUDA numbers cards
//! fastest-first unless `CUDA_DEVICE_ORDER=PCI_BUS_ID`. The UUID is the same everywhere, so a
//! task in a container and one on the host that share the lock folder never share a card.
//!
//! A card listed k times (`0,0`) has k slots: up to k tasks of that list run on it at once, an
//! explicit opt-in; otherwise at most one task holds a card.

use std::fs::File;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::GpuError;
use crate::env::EnvVars;

/// The cards a task may take, as given to `--gpu`: ordinals as `nvidia-smi` numbers them (PCI
/// bus order), or every card of the machine where the task runs.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub enum GpuList {
    /// Every card the task's machine has (resolved there, not where the command was typed).
    All,
    /// These ordinals, in order; a repeated ordinal lets that many tasks share the card.
    Cards(Vec<u32>),
}

impl std::str::FromStr for GpuList {
    type Err = String;

    fn from_str(s: &str) -> Result<GpuList, String> {
        let s = s.trim();
        if s.eq_ignore_ascii_case("all") {
            return Ok(GpuList::All);
        }
        let mut cards = Vec::new();
        for part in s.split(',').map(str::trim) {
            let num = |t: &str| t.trim().parse::<u32>().map_err(|_| format!("`{t}` in `{s}` is not a GPU number: give ordinals (`0`), lists (`0,1,2,3`), ranges (`0-3`) or `all`"));
            match part.split_once('-') {
                _ if part.is_empty() => return Err(format!("`{s}` has an empty entry: give ordinals (`0`), lists (`0,1,2,3`), ranges (`0-3`) or `all`")),
                Some((a, b)) => {
                    let (a, b) = (num(a)?, num(b)?);
                    if a > b {
                        return Err(format!("the range `{part}` runs backwards: write `{b}-{a}`"));
                    }
                    if b - a >= 1024 {
                        return Err(format!("the range `{part}` names more than 1024 GPUs"));
                    }
                    cards.extend(a..=b);
                }
                None => cards.push(num(part)?),
            }
        }
        Ok(GpuList::Cards(cards))
    }
}

impl std::fmt::Display for GpuList {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            GpuList::All => f.write_str("all"),
            GpuList::Cards(c) => f.write_str(&c.iter().map(u32::to_string).collect::<Vec<_>>().join(",")),
        }
    }
}

impl TryFrom<String> for GpuList {
    type Error = String;
    fn try_from(s: String) -> Result<GpuList, String> {
        s.parse()
    }
}

impl From<GpuList> for String {
    fn from(g: GpuList) -> String {
        g.to_string()
    }
}

impl GpuList {
    /// How many tasks may run at once on this list: its entries, repeats included; `all`
    /// counts the cards of this machine (at least 1).
    pub fn slots_here(&self) -> usize {
        match self {
            GpuList::Cards(c) => c.len().max(1),
            GpuList::All => list_cards().map(|c| c.len()).unwrap_or(1).max(1),
        }
    }

    /// The distinct ordinals in ascending order (what a container is given); `None` for `all`.
    pub fn distinct(&self) -> Option<Vec<u32>> {
        match self {
            GpuList::All => None,
            GpuList::Cards(c) => {
                let mut d = c.clone();
                d.sort_unstable();
                d.dedup();
                Some(d)
            }
        }
    }

    /// The same list as a container that sees only `distinct()` numbers it: the cards become
    /// 0..n in ascending order of their host ordinals (PCI order), repeats kept.
    pub fn renumbered(&self) -> GpuList {
        match (self, self.distinct()) {
            (GpuList::Cards(c), Some(d)) => GpuList::Cards(c.iter().map(|o| d.binary_search(o).unwrap_or(0) as u32).collect()),
            _ => GpuList::All,
        }
    }
}

/// One card as the driver lists it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Card {
    /// nvidia-smi's index (PCI bus order) on the machine, or in the container, that listed it.
    pub ordinal: u32,
    /// `GPU-xxxxxxxx-...`: the same on the host and in every container.
    pub uuid: String,
}

/// The cards of this machine, from the driver, without initialising CUDA: `$SCFOUNDRY_FAKE_GPUS`
/// (a test hook), else `nvidia-smi --query-gpu=index,uuid`, else /proc/driver/nvidia/gpus/*
/// (numbered in PCI bus order, as nvidia-smi does).
pub fn list_cards() -> Result<Vec<Card>, GpuError> {
    if let Ok(fake) = std::env::var(EnvVars::FAKE_GPUS) {
        return parse_fake(&fake);
    }
    if let Ok(out) = std::process::Command::new("nvidia-smi").args(["--query-gpu=index,uuid", "--format=csv,noheader"]).stderr(std::process::Stdio::null()).output() {
        if out.status.success() {
            let cards = parse_smi(&String::from_utf8_lossy(&out.stdout));
            if !cards.is_empty() {
                return Ok(cards);
            }
        }
    }
    let cards = read_proc(Path::new("/proc/driver/nvidia/gpus"));
    if cards.is_empty() {
        return Err(GpuError::Cards {
            detail: "no GPU found: `nvidia-smi` is missing or lists none, and /proc/driver/nvidia/gpus is empty".into(),
            hint: "run where the NVIDIA driver is loaded (`nvidia-smi -L` lists the cards); in a container, pass the cards in (docker --gpus, apptainer --nv)".into(),
        });
    }
    Ok(cards)
}

/// `0:GPU-aaaa,1:GPU-bbbb`.
fn parse_fake(s: &str) -> Result<Vec<Card>, GpuError> {
    s.split(',')
        .map(str::trim)
        .filter(|p| !p.is_empty())
        .map(|p| {
            let (o, u) = p.split_once(':').ok_or_else(|| GpuError::Cards { detail: format!("${}: `{p}` is not ORDINAL:UUID", EnvVars::FAKE_GPUS), hint: format!("e.g. {}=0:GPU-aaaa,1:GPU-bbbb", EnvVars::FAKE_GPUS) })?;
            let ordinal = o.trim().parse().map_err(|_| GpuError::Cards { detail: format!("${}: `{o}` is not a number", EnvVars::FAKE_GPUS), hint: format!("e.g. {}=0:GPU-aaaa,1:GPU-bbbb", EnvVars::FAKE_GPUS) })?;
            Ok(Card { ordinal, uuid: u.trim().to_string() })
        })
        .collect()
}

/// nvidia-smi's `index, uuid` lines.
fn parse_smi(text: &str) -> Vec<Card> {
    text.lines()
        .filter_map(|l| {
            let (i, u) = l.split_once(',')?;
            Some(Card { ordinal: i.trim().parse().ok()?, uuid: u.trim().to_string() })
        })
        .filter(|c| c.uuid.starts_with("GPU-") || c.uuid.starts_with("MIG-"))
        .collect()
}

/// `/proc/driver/nvidia/gpus/<pci bus id>/information`'s `GPU UUID:` lines; the folders sorted
/// by bus id give the ordinals.
fn read_proc(dir: &Path) -> Vec<Card> {
    let Ok(entries) = std::fs::read_dir(dir) else { return vec![] };
    let mut buses: Vec<PathBuf> = entries.filter_map(|e| e.ok()).map(|e| e.path()).collect();
    buses.sort();
    buses
        .iter()
        .filter_map(|b| {
            let text = std::fs::read_to_string(b.join("information")).ok()?;
            text.lines().find_map(|l| l.strip_prefix("GPU UUID:").map(|u| u.trim().to_string()))
        })
        .enumerate()
        .map(|(i, uuid)| Card { ordinal: i as u32, uuid })
        .collect()
}

/// The node-local folder of the card locks: `$SCFOUNDRY_GPU_LOCKS`, else
/// `/tmp/scfoundry-gpu-locks-<uid>`. /tmp rather than
/// $XDG_RUNTIME_DIR: that is unset in batch jobs, cron and containers, and two tasks of one user
/// must find the same folder whatever started them. Per user, so that no user can hold
/// another's lock files open; tasks of different users coordinate by sharing a folder
/// (`SCFOUNDRY_GPU_LOCKS=/shared/folder`).
pub fn lock_dir() -> PathBuf {
    if let Some(d) = std::env::var_os(EnvVars::GPU_LOCKS).filter(|d| !d.is_empty()) {
        return PathBuf::from(d);
    }
    PathBuf::from(format!("/tmp/scfoundry-gpu-locks-{}", unsafe { libc::getuid() }))
}

/// The card a task holds; dropping it (or the process ending) frees the card.
#[derive(Debug)]
pub struct HeldCard {
    pub card: Card,
    /// Which of the card's slots (0 unless the list repeats the card).
    pub slot: usize,
    /// Seconds spent waiting for it.
    pub waited_s: f64,
    _file: File,
}

/// What a task records about its card (result.json and the run's report).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CardRecord {
    pub ordinal: u32,
    pub uuid: String,
    #[serde(default)]
    pub slot: usize,
    #[serde(default)]
    pub waited_s: f64,
}

impl HeldCard {
    pub fn record(&self) -> CardRecord {
        CardRecord { ordinal: self.card.ordinal, uuid: self.card.uuid.clone(), slot: self.slot, waited_s: self.waited_s }
    }
}

/// The (card, slot) pairs a list allows on this machine, in the list's order. `all` is every
/// card, restricted to those an inherited `CUDA_VISIBLE_DEVICES` names (by index or UUID) when
/// it is set, e.g. by a scheduler; an explicit list names driver ordinals and replaces it.
pub fn candidates(list: &GpuList, cards: &[Card], inherited_visible: Option<&str>) -> Result<Vec<(Card, usize)>, GpuError> {
    let have = || cards.iter().map(|c| c.ordinal.to_string()).collect::<Vec<_>>().join(", ");
    match list {
        GpuList::All => {
            let allowed: Vec<&Card> = match inherited_visible.map(str::trim).filter(|v| !v.is_empty()) {
                None => cards.iter().collect(),
                Some(v) => v
                    .split(',')
                    .map(str::trim)
                    .filter_map(|e| cards.iter().find(|c| e.parse::<u32>().ok() == Some(c.ordinal) || (e.len() >= 8 && c.uuid.starts_with(e))))
                    .collect(),
            };
            if allowed.is_empty() {
                return Err(GpuError::Cards { detail: "--gpu all: no card found".into(), hint: "`nvidia-smi -L` lists the cards; CUDA_VISIBLE_DEVICES, when set, must name some of them".into() });
            }
            Ok(allowed.into_iter().map(|c| (c.clone(), 0)).collect())
        }
        GpuList::Cards(ords) => {
            let mut out: Vec<(Card, usize)> = Vec::new();
            for o in ords {
                let card = cards.iter().find(|c| c.ordinal == *o).ok_or_else(|| GpuError::Cards {
                    detail: format!("--gpu {list}: this machine has no GPU {o} (it has {})", have()),
                    hint: "`nvidia-smi -L` lists the cards by number; pass --gpu with some of them, or --gpu all".into(),
                })?;
                let slot = out.iter().filter(|(c, _)| c.ordinal == *o).count();
                out.push((card.clone(), slot));
            }
            Ok(out)
        }
    }
}

fn try_lock(dir: &Path, card: &Card, slot: usize) -> Result<Option<File>, GpuError> {
    let path = dir.join(format!("{}.{slot}.lock", card.uuid));
    let io = |e: std::io::Error| GpuError::LockFolder { path: path.clone(), detail: e.to_string() };
    let f = std::fs::OpenOptions::new().create(true).truncate(false).read(true).write(true).open(&path).map_err(io)?;
    loop {
        if unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } == 0 {
            return Ok(Some(f));
        }
        let e = std::io::Error::last_os_error();
        match e.raw_os_error() {
            Some(libc::EINTR) => continue,
            Some(libc::EWOULDBLOCK) => return Ok(None),
            _ => return Err(io(e)),
        }
    }
}

/// Take a free card of `list` (its first free slot in the list's order), waiting while all
/// are held; `on_wait` is called once, before waiting. The lock folder is created (mode 0700).
pub fn take(list: &GpuList, dir: &Path, on_wait: impl FnOnce(&str)) -> Result<HeldCard, GpuError> {
    let cards = list_cards()?;
    let inherited = std::env::var("CUDA_VISIBLE_DEVICES").ok();
    let cands = candidates(list, &cards, inherited.as_deref())?;
    if !dir.exists() {
        use std::os::unix::fs::DirBuilderExt;
        std::fs::DirBuilder::new().recursive(true).mode(0o700).create(dir).map_err(|e| GpuError::LockFolder { path: dir.into(), detail: e.to_string() })?;
    }
    let started = std::time::Instant::now();
    let mut on_wait = Some(on_wait);
    let mut pause = Duration::from_millis(20);
    loop {
        for (card, slot) in &cands {
            if let Some(f) = try_lock(dir, card, *slot)? {
                return Ok(HeldCard { card: card.clone(), slot: *slot, waited_s: started.elapsed().as_secs_f64(), _file: f });
            }
        }
        if let Some(w) = on_wait.take() {
            let names = cands.iter().map(|(c, _)| c.ordinal.to_string()).collect::<Vec<_>>().join(",");
            w(&format!("waiting for a free GPU among {names} (other tasks hold them; locks in {})", dir.display()));
        }
        std::thread::sleep(pause);
        pause = (pause * 2).min(Duration::from_millis(250));
    }
}

/// Make the held card the only one CUDA sees. Called before the process's first CUDA call (CUDA
/// reads the variable once, at initialisation). The UUID rather than an ordinal: CUDA's own
/// numbering follows CUDA_DEVICE_ORDER (fastest first by default), which need not be the
/// driver's PCI order that `--gpu` numbers, and a UUID names the same card in any container.
pub fn make_visible(held: &HeldCard) {
    std::env::set_var("CUDA_VISIBLE_DEVICES", &held.card.uuid);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(s: &str) -> GpuList {
        s.parse().unwrap()
    }

    #[test]
    fn lists_ranges_and_all_parse() {
        assert_eq!(p("0"), GpuList::Cards(vec![0]));
        assert_eq!(p("0,1,2,3"), GpuList::Cards(vec![0, 1, 2, 3]));
        assert_eq!(p("0-3"), GpuList::Cards(vec![0, 1, 2, 3]));
        assert_eq!(p(" 1-2, 5 "), GpuList::Cards(vec![1, 2, 5]));
        assert_eq!(p("0,0"), GpuList::Cards(vec![0, 0]));
        assert_eq!(p("all"), GpuList::All);
        assert_eq!(p("ALL"), GpuList::All);
        for bad in ["", "a", "0,,1", "3-1", "-1", "0-", "1.5", "0-5000"] {
            assert!(bad.parse::<GpuList>().is_err(), "`{bad}` should be refused");
        }
        assert!("3-1".parse::<GpuList>().unwrap_err().contains("1-3"));
        // text and JSON round trips
        for s in ["0", "0,1,2,3", "0,0", "all"] {
            assert_eq!(p(s).to_string(), s);
            let j = serde_json::to_string(&p(s)).unwrap();
            assert_eq!(serde_json::from_str::<GpuList>(&j).unwrap(), p(s));
        }
        assert_eq!(p("0-3").to_string(), "0,1,2,3");
    }

    #[test]
    fn slots_distinct_and_renumbering() {
        assert_eq!(p("0,0,1").slots_here(), 3);
        assert_eq!(p("3,1,3").distinct(), Some(vec![1, 3]));
        assert_eq!(p("3,1,3").renumbered(), p("1,0,1"));
        assert_eq!(p("2-3").renumbered(), p("0,1"));
        assert_eq!(p("all").distinct(), None);
    }

    #[test]
    fn driver_listings_parse() {
        let smi = "0, GPU-5d1e8f2a-aaaa\n1, GPU-77c0ffee-bbbb\nNo devices were found\n";
        assert_eq!(parse_smi(smi), vec![Card { ordinal: 0, uuid: "GPU-5d1e8f2a-aaaa".into() }, Card { ordinal: 1, uuid: "GPU-77c0ffee-bbbb".into() }]);
        assert_eq!(parse_fake("0:GPU-aaaa, 1:GPU-bbbb").unwrap()[1], Card { ordinal: 1, uuid: "GPU-bbbb".into() });
        assert!(parse_fake("GPU-aaaa").is_err());
        let dir = tempfile::tempdir().unwrap();
        for (bus, uuid) in [("0000:c1:00.0", "GPU-cccc"), ("0000:41:00.0", "GPU-4444")] {
            std::fs::create_dir_all(dir.path().join(bus)).unwrap();
            std::fs::write(dir.path().join(bus).join("information"), format!("Model: \t\t NVIDIA H200\nIRQ:   \t\t 42\nGPU UUID: \t {uuid}\n")).unwrap();
        }
        let cards = read_proc(dir.path());
        assert_eq!(cards, vec![Card { ordinal: 0, uuid: "GPU-4444".into() }, Card { ordinal: 1, uuid: "GPU-cccc".into() }]);
    }

    #[test]
    fn candidates_follow_the_list_and_the_inherited_devices() {
        let cards = parse_fake("0:GPU-aaaa0000,1:GPU-bbbb1111,2:GPU-cccc2222").unwrap();
        let ords = |v: Vec<(Card, usize)>| v.into_iter().map(|(c, s)| (c.ordinal, s)).collect::<Vec<_>>();
        assert_eq!(ords(candidates(&p("2,0"), &cards, None).unwrap()), vec![(2, 0), (0, 0)]);
        assert_eq!(ords(candidates(&p("0,0,1"), &cards, None).unwrap()), vec![(0, 0), (0, 1), (1, 0)]);
        assert_eq!(ords(candidates(&p("all"), &cards, None).unwrap()), vec![(0, 0), (1, 0), (2, 0)]);
        // a scheduler's CUDA_VISIBLE_DEVICES narrows `all`, by index or UUID
        assert_eq!(ords(candidates(&p("all"), &cards, Some("2,GPU-aaaa0000")).unwrap()), vec![(2, 0), (0, 0)]);
        // an explicit list is the user's and replaces it
        assert_eq!(ords(candidates(&p("1"), &cards, Some("2")).unwrap()), vec![(1, 0)]);
        let e = candidates(&p("0,7"), &cards, None).unwrap_err().to_string();
        assert!(e.contains("no GPU 7") && e.contains("0, 1, 2"), "{e}");
    }

    #[test]
    fn a_held_card_is_skipped_and_a_repeated_card_is_shared() {
        let dir = tempfile::tempdir().unwrap();
        let cards = parse_fake("0:GPU-aaaa,1:GPU-bbbb").unwrap();
        let a = try_lock(dir.path(), &cards[0], 0).unwrap().expect("free");
        assert!(try_lock(dir.path(), &cards[0], 0).unwrap().is_none(), "slot 0 of card 0 is held");
        assert!(try_lock(dir.path(), &cards[0], 1).unwrap().is_some(), "a second slot of card 0 is another lock");
        drop(a);
        assert!(try_lock(dir.path(), &cards[0], 0).unwrap().is_some(), "freed on drop");
    }
}
