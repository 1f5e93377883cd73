//! Where a training step's time goes, by named region of the model, forward and backward
//! (`SCFOUNDRY_STEP_PROFILE=1`; off, it costs nothing). The forward pass is cut at marks: at each
//! the device is synchronised and the time since the previous mark goes to the region that ends
//! there. Each mark is also an identity op in the graph whose backward synchronises the device
//! and takes the time since the previous backward mark, which is the backward pass of the region
//! that the previous mark ended (the gradient flows from the loss back through the marks in the
//! reverse order). Synchronising at every mark costs some overlap, so the sum is a little above
//! an unprofiled step; the shares are what it is for. Names repeated across layers add up.
//! Parts timed inside a region ([`StepProfile::part`], named "region: part") are also counted
//! in the region. The first [`WARM_UP`] steps are left out of the tally (module loads, algorithm
//! choices and the memory pool's growth happen there, and would dominate a short run).

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use candle_core::{CpuStorage, Device, Layout, Result, Shape, Tensor};

/// Steps at the start that the tally leaves out.
pub const WARM_UP: usize = 2;

#[derive(Default)]
struct Clock {
    /// Steps started so far.
    steps: usize,
    forward_from: Option<Instant>,
    backward_from: Option<(Instant, String)>,
    /// region -> (forward s, backward s)
    seconds: BTreeMap<String, (f64, f64)>,
}

/// The profile of the steps run so far (cheap to clone; clones share the tally).
#[derive(Clone)]
pub struct StepProfile {
    device: Device,
    clock: Arc<Mutex<Clock>>,
}

impl StepProfile {
    /// A profile when `SCFOUNDRY_STEP_PROFILE` is set to a value other than `0`, else None.
    pub fn from_env(device: &Device) -> Option<StepProfile> {
        match std::env::var("SCFOUNDRY_STEP_PROFILE") {
            Ok(v) if !v.is_empty() && v != "0" => Some(StepProfile { device: device.clone(), clock: Arc::default() }),
            _ => None,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Clock> {
        self.clock.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Start of a step's forward pass.
    pub fn start(&self) -> Result<()> {
        self.device.synchronize()?;
        let mut c = self.lock();
        c.steps += 1;
        if c.steps == WARM_UP + 1 {
            c.seconds.clear();
        }
        c.forward_from = Some(Instant::now());
        Ok(())
    }

    /// Steps in the tally (those after the warm-up; all of them when there were no more).
    pub fn steps_counted(&self) -> usize {
        let n = self.lock().steps;
        if n > WARM_UP {
            n - WARM_UP
        } else {
            n
        }
    }

    /// The end of region `name` in the forward pass: `x`, with a mark on its gradient.
    pub fn mark(&self, x: &Tensor, name: &str) -> Result<Tensor> {
        self.device.synchronize()?;
        let now = Instant::now();
        {
            let mut c = self.lock();
            let from = c.forward_from.replace(now).unwrap_or(now);
            c.seconds.entry(name.to_string()).or_default().0 += (now - from).as_secs_f64();
        }
        if !x.track_op() {
            return Ok(x.clone());
        }
        x.apply_op1_arc(Arc::new(Box::new(Mark { name: name.to_string(), profile: self.clone() })))
    }

    /// Start of the backward pass (`after`: the region between the last mark and the loss).
    pub fn start_backward(&self, after: &str) -> Result<()> {
        self.device.synchronize()?;
        let now = Instant::now();
        let mut c = self.lock();
        if let Some(from) = c.forward_from.take() {
            c.seconds.entry(after.to_string()).or_default().0 += (now - from).as_secs_f64();
        }
        c.backward_from = Some((now, after.to_string()));
        Ok(())
    }

    /// End of the backward pass: the rest goes to the region that ends at the first mark.
    pub fn end_backward(&self) -> Result<()> {
        self.backward_mark("")?;
        self.lock().backward_from = None;
        Ok(())
    }

    fn backward_mark(&self, name: &str) -> Result<()> {
        self.device.synchronize()?;
        let now = Instant::now();
        let mut c = self.lock();
        if let Some((from, region)) = c.backward_from.replace((now, name.to_string())) {
            c.seconds.entry(region).or_default().1 += (now - from).as_secs_f64();
        }
        Ok(())
    }

    /// `f` timed as part `name` of a region (the device synchronised before and after); its time
    /// is also in the enclosing region's, forward or `backward`.
    pub fn part<T>(&self, name: &str, backward: bool, f: impl FnOnce() -> Result<T>) -> Result<T> {
        self.device.synchronize()?;
        let t = Instant::now();
        let out = f()?;
        self.device.synchronize()?;
        let s = t.elapsed().as_secs_f64();
        let mut c = self.lock();
        let e = c.seconds.entry(name.to_string()).or_default();
        if backward {
            e.1 += s;
        } else {
            e.0 += s;
        }
        Ok(out)
    }

    /// (region, forward seconds, backward seconds), slowest first.
    pub fn table(&self) -> Vec<(String, f64, f64)> {
        let mut v: Vec<(String, f64, f64)> = self.lock().seconds.iter().map(|(k, &(f, b))| (k.clone(), f, b)).collect();
        v.sort_by(|a, b| (b.1 + b.2).total_cmp(&(a.1 + a.2)));
        v
    }

    /// The table as TSV, after a comment line with the steps it counts.
    pub fn tsv(&self) -> String {
        let mut s = format!("# {} steps (the first {WARM_UP} left out when there were more)\nregion\tforward_s\tbackward_s\n", self.steps_counted());
        for (r, f, b) in self.table() {
            s += &format!("{r}\t{f:.3}\t{b:.3}\n");
        }
        s
    }
}

/// The identity whose backward records a mark.
struct Mark {
    name: String,
    profile: StepProfile,
}

impl candle_core::CustomOp1 for Mark {
    fn name(&self) -> &'static str {
        "step-profile-mark"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        Ok((candle_core::backend::BackendStorage::try_clone(s, l)?, l.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, s: &candle_core::CudaStorage, l: &Layout) -> Result<(candle_core::CudaStorage, Shape)> {
        Ok((candle_core::backend::BackendStorage::try_clone(s, l)?, l.shape().clone()))
    }

    fn bwd(&self, _arg: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        // the gradient reached the end of region `name`: what ran since the previous mark was
        // the backward pass of the region after it
        self.profile.backward_mark(&self.name)?;
        Ok(Some(grad.clone()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Var;

    #[test]
    fn marks_pass_values_and_gradients_through_and_split_the_time() {
        let dev = Device::Cpu;
        let p = StepProfile { device: dev.clone(), clock: Arc::default() };
        let x = Var::new(&[1f32, 2.0, 3.0], &dev).unwrap();
        p.start().unwrap();
        let a = p.mark(&(x.as_tensor() * 2.0).unwrap(), "double").unwrap();
        let b = p.mark(&a.sqr().unwrap(), "square").unwrap();
        let loss = b.sum_all().unwrap();
        p.start_backward("loss").unwrap();
        let g = loss.backward().unwrap();
        p.end_backward().unwrap();
        // d/dx sum((2x)^2) = 8x
        assert_eq!(g.get(x.as_tensor()).unwrap().to_vec1::<f32>().unwrap(), vec![8.0, 16.0, 24.0]);
        let names: Vec<String> = p.table().into_iter().map(|r| r.0).collect();
        for n in ["double", "square", "loss"] {
            assert!(names.contains(&n.to_string()), "{n} missing from {names:?}");
        }
        assert!(p.tsv().contains("\nregion\tforward_s\tbackward_s\n"));
        assert_eq!(p.steps_counted(), 1);
    }

    #[test]
    fn the_warm_up_steps_are_left_out() {
        let dev = Device::Cpu;
        let p = StepProfile { device: dev.clone(), clock: Arc::default() };
        let x = Var::new(&[1f32], &dev).unwrap();
        for step in 0..WARM_UP + 2 {
            p.start().unwrap();
            // a region only the warm-up steps have
            let name = if step < WARM_UP { "warm-up only" } else { "later" };
            let _ = p.mark(x.as_tensor(), name).unwrap();
        }
        let names: Vec<String> = p.table().into_iter().map(|r| r.0).collect();
        assert_eq!(names, vec!["later".to_string()]);
        assert_eq!(p.steps_counted(), 2);
    }
}
