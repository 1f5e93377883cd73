//! numpy's legacy random generator (MT19937, `RandomState`), reproduced draw for draw: models
//! whose upstream tokenizers draw with numpy (scGPT's binning and sampling, UCE, Cell2Sentence,
//! scPRINT's collator) make the same choices here.
//!
//! Two front ends of the one generator: [`Mt19937`] (`np.random.seed(s)`, `rand`,
//! `permutation`) and [`RandomState`] (the draws `np.random.choice` makes).

/// A generator's whole state, as a sharded run saves it for a shard that starts mid-stream: the
/// 624 state words and the position of the next word (numpy's `get_state()` gives the same
/// pair; neither front end here draws gaussians, so there is no cached one to keep).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct RngState {
    pub words: Vec<u32>,
    pub pos: usize,
}

impl RngState {
    fn words(&self) -> Option<[u32; 624]> {
        (self.pos <= 624).then_some(())?;
        self.words.as_slice().try_into().ok()
    }
}

/// numpy's legacy `RandomState` (MT19937): `np.random.seed(s)` for a 32-bit `s`, and the draws
/// `rand` and `permutation` make.
#[derive(Clone)]
pub struct Mt19937 {
    mt: [u32; 624],
    pos: usize,
}

impl Mt19937 {
    /// `np.random.seed(seed)` (mt19937_seed: Knuth's linear recurrence).
    pub fn new(seed: u32) -> Mt19937 {
        let mut mt = [0u32; 624];
        mt[0] = seed;
        for i in 1..624 {
            mt[i] = 1812433253u32.wrapping_mul(mt[i - 1] ^ (mt[i - 1] >> 30)).wrapping_add(i as u32);
        }
        Mt19937 { mt, pos: 624 }
    }

    /// The state to resume from ([`Mt19937::from_state`]).
    pub fn state(&self) -> RngState {
        RngState { words: self.mt.to_vec(), pos: self.pos }
    }

    /// The generator a [`RngState`] describes; `None` for a state that is not one (not 624
    /// words, or a position past them).
    pub fn from_state(s: &RngState) -> Option<Mt19937> {
        Some(Mt19937 { mt: s.words()?, pos: s.pos })
    }

    /// `init_by_array(key)`: CPython's `random.seed(int)` (the int's 32-bit words, low first).
    pub fn by_array(key: &[u32]) -> Mt19937 {
        const N: usize = 624;
        let mut r = Mt19937::new(19650218);
        let mt = &mut r.mt;
        let (mut i, mut j) = (1usize, 0usize);
        let len = key.len().max(1);
        for _ in 0..N.max(len) {
            let prev = mt[i - 1] ^ (mt[i - 1] >> 30);
            mt[i] = (mt[i] ^ prev.wrapping_mul(1664525)).wrapping_add(key.get(j).copied().unwrap_or(0)).wrapping_add(j as u32);
            i += 1;
            j += 1;
            if i >= N {
                mt[0] = mt[N - 1];
                i = 1;
            }
            if j >= len {
                j = 0;
            }
        }
        for _ in 0..N - 1 {
            let prev = mt[i - 1] ^ (mt[i - 1] >> 30);
            mt[i] = (mt[i] ^ prev.wrapping_mul(1566083941)).wrapping_sub(i as u32);
            i += 1;
            if i >= N {
                mt[0] = mt[N - 1];
                i = 1;
            }
        }
        mt[0] = 0x8000_0000;
        r
    }

    fn generate(&mut self) {
        const UPPER: u32 = 0x8000_0000;
        const LOWER: u32 = 0x7fff_ffff;
        const MATRIX_A: u32 = 0x9908_b0df;
        for i in 0..624 {
            let y = (self.mt[i] & UPPER) | (self.mt[(i + 1) % 624] & LOWER);
            let mag = if y & 1 == 1 { MATRIX_A } else { 0 };
            self.mt[i] = self.mt[(i + 397) % 624] ^ (y >> 1) ^ mag;
        }
        self.pos = 0;
    }

    pub fn next_u32(&mut self) -> u32 {
        if self.pos >= 624 {
            self.generate();
        }
        let mut y = self.mt[self.pos];
        self.pos += 1;
        y ^= y >> 11;
        y ^= (y << 7) & 0x9d2c_5680;
        y ^= (y << 15) & 0xefc6_0000;
        y ^ (y >> 18)
    }

    /// One `np.random.rand()` draw: 53 random bits in [0, 1).
    pub fn next_f64(&mut self) -> f64 {
        let a = (self.next_u32() >> 5) as f64;
        let b = (self.next_u32() >> 6) as f64;
        (a * 67108864.0 + b) / 9007199254740992.0
    }

    /// numpy's `random_interval(max)`: uniform in 0..=max by masked rejection.
    fn interval(&mut self, max: u32) -> u32 {
        if max == 0 {
            return 0;
        }
        let mut mask = max;
        for s in [1, 2, 4, 8, 16] {
            mask |= mask >> s;
        }
        loop {
            let v = self.next_u32() & mask;
            if v <= max {
                return v;
            }
        }
    }

    /// `np.random.permutation(n)` (legacy shuffle of `arange(n)`, Fisher-Yates from the end).
    pub fn permutation(&mut self, n: usize) -> Vec<usize> {
        let mut a: Vec<usize> = (0..n).collect();
        for i in (1..n).rev() {
            let j = self.interval(i as u32) as usize;
            a.swap(i, j);
        }
        a
    }
}

/// numpy's legacy global `RandomState` (MT19937), the draws Collator's `np.random.choice` makes.
#[derive(Clone)]
pub struct RandomState {
    mt: Box<[u32; 624]>,
    pos: usize,
}

impl RandomState {
    /// `np.random.seed(seed)` for an integer seed (`mt19937_seed`: Knuth's init_genrand).
    pub fn new(seed: u32) -> RandomState {
        let mut mt = Box::new([0u32; 624]);
        mt[0] = seed;
        for i in 1..624 {
            mt[i] = 1_812_433_253u32.wrapping_mul(mt[i - 1] ^ (mt[i - 1] >> 30)).wrapping_add(i as u32);
        }
        RandomState { mt, pos: 624 }
    }

    /// The state to resume from ([`RandomState::from_state`]).
    pub fn state(&self) -> RngState {
        RngState { words: self.mt.to_vec(), pos: self.pos }
    }

    /// The generator a [`RngState`] describes; `None` for a state that is not one.
    pub fn from_state(s: &RngState) -> Option<RandomState> {
        Some(RandomState { mt: Box::new(s.words()?), pos: s.pos })
    }

    fn generate(&mut self) {
        const UPPER: u32 = 0x8000_0000;
        const LOWER: u32 = 0x7fff_ffff;
        for i in 0..624 {
            let y = (self.mt[i] & UPPER) | (self.mt[(i + 1) % 624] & LOWER);
            let mut v = self.mt[(i + 397) % 624] ^ (y >> 1);
            if y & 1 != 0 {
                v ^= 0x9908_b0df;
            }
            self.mt[i] = v;
        }
        self.pos = 0;
    }

    /// genrand_int32.
    pub fn next_u32(&mut self) -> u32 {
        if self.pos >= 624 {
            self.generate();
        }
        let mut y = self.mt[self.pos];
        self.pos += 1;
        y ^= y >> 11;
        y ^= (y << 7) & 0x9d2c_5680;
        y ^= (y << 15) & 0xefc6_0000;
        y ^ (y >> 18)
    }

    /// numpy's legacy `random_interval(max)`: a uniform integer in [0, max] by masked rejection.
    fn interval(&mut self, max: u32) -> u32 {
        if max == 0 {
            return 0;
        }
        let mut mask = max;
        mask |= mask >> 1;
        mask |= mask >> 2;
        mask |= mask >> 4;
        mask |= mask >> 8;
        mask |= mask >> 16;
        loop {
            let v = self.next_u32() & mask;
            if v <= max {
                return v;
            }
        }
    }

    /// `permutation(n)`: arange(n) shuffled as the legacy `shuffle` does (i from n-1 down to 1,
    /// swapped with random_interval(i)).
    pub fn permutation(&mut self, n: usize) -> Vec<u32> {
        let mut a: Vec<u32> = (0..n as u32).collect();
        for i in (1..n).rev() {
            let j = self.interval(i as u32) as usize;
            a.swap(i, j);
        }
        a
    }

    /// `choice(n, k, replace=False)` (legacy: `permutation(n)[:k]`).
    pub fn choice(&mut self, n: usize, k: usize) -> Vec<u32> {
        let mut p = self.permutation(n);
        p.truncate(k);
        p
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_saved_state_resumes_the_same_stream() {
        let mut a = RandomState::new(7);
        a.permutation(1000);
        let saved = serde_json::to_string(&a.state()).unwrap();
        let mut b = RandomState::from_state(&serde_json::from_str(&saved).unwrap()).unwrap();
        assert_eq!(a.permutation(2000), b.permutation(2000));
        let mut m = Mt19937::new(3);
        m.next_f64();
        let mut n = Mt19937::from_state(&m.state()).unwrap();
        assert_eq!((0..700).map(|_| m.next_u32()).collect::<Vec<_>>(), (0..700).map(|_| n.next_u32()).collect::<Vec<_>>());
        assert!(RandomState::from_state(&RngState { words: vec![0; 10], pos: 0 }).is_none());
        assert!(Mt19937::from_state(&RngState { words: vec![0; 624], pos: 625 }).is_none());
    }
}
