//! Gated DeltaNet layers on the device: [`Backend::gated_delta_net`] as one
//! `gated_delta_net` launch (a block per sequence and query/key head group,
//! see `kernels/recurrent.cu`) over the state slots where they live, and
//! gated attention's `sigmoid_mul`.
//!
//! The call is checked as the CPU checks it ([`GatedDeltaNet::check`]); the
//! per-sequence table (rows, slot, fresh, snapshots) is uploaded with the
//! launch. Shapes the kernel does not take (a query/key head wider than
//! `GDN_MAX_K_DIM`, a group of value heads wider than a block) run through
//! the host default instead. A step with a recurrent layer is not captured
//! as a graph: its table changes every step.

use crate::GpuBackend;
use crate::exec::Args;
use crate::kernels::K;
use crate::ops::stride_grid;
use arbor_engine_core::backend::recurrent::{GatedDeltaNet, gated_delta_net_on_host};
use arbor_engine_core::{Backend, DType, Result, Tensor};

/// The widest query/key head the kernel holds (`GDN_MAX_K_DIM`).
const MAX_K_DIM: usize = 256;
/// The most threads of a block.
const MAX_BLOCK: usize = 1024;

impl GpuBackend {
    pub(crate) fn op_gated_delta_net(&self, call: &GatedDeltaNet<'_>) -> Result<()> {
        call.check()?;
        let s = call.spec;
        let columns = s.group() * s.v_dim;
        if s.k_dim > MAX_K_DIM || columns > MAX_BLOCK || s.conv_kernel < 2 {
            return gated_delta_net_on_host(self, call);
        }
        if call.seqs.is_empty() {
            return Ok(());
        }
        let mut seqs = Vec::with_capacity(6 * call.seqs.len());
        let mut snaps = Vec::new();
        for q in call.seqs {
            seqs.extend([
                q.rows.start as u32,
                q.rows.len() as u32,
                q.slot,
                u32::from(q.fresh),
                (snaps.len() / 2) as u32,
                q.snapshots.len() as u32,
            ]);
            for &(n, dst) in &q.snapshots {
                snaps.extend([n as u32, dst]);
            }
        }
        if snaps.is_empty() {
            snaps.extend([0, 0]);
        }
        let dev: &dyn Backend = self;
        let seq_table = dev.upload_u32(&[seqs.len()], &seqs)?;
        let snap_table = dev.upload_u32(&[snaps.len()], &snaps)?;
        let threads = columns.next_multiple_of(32).clamp(32, MAX_BLOCK);
        let smem = (2 * s.k_dim + columns + 2) * 4;
        let w = &call.weights;
        let mut st = self.dev.lock()?;
        st.no_graph("a recurrent layer's sequence table changes every step");
        let args = Args::new()
            .p(self.p(&st, call.mixed)?)
            .p(self.p(&st, call.a)?)
            .p(self.p(&st, call.b)?)
            .p(self.p(&st, w.conv)?)
            .p(self.p(&st, w.a_log)?)
            .p(self.p(&st, w.dt_bias)?)
            .p(self.p(&st, &call.state.conv)?)
            .p(self.p(&st, &call.state.recurrent)?)
            .p(self.p(&st, call.out)?)
            .p(self.p(&st, &seq_table)?)
            .p(self.p(&st, &snap_table)?)
            .i(s.conv_channels)
            .i(s.conv_kernel)
            .i(s.k_heads)
            .i(s.v_heads)
            .i(s.k_dim)
            .i(s.v_dim);
        let grid = [call.seqs.len(), s.k_heads, 1];
        self.dev.launch(
            &mut st,
            K::GatedDeltaNet,
            grid,
            threads as u32,
            smem as u32,
            args,
        )
    }

    pub(crate) fn op_sigmoid_mul(&self, gate: &Tensor, x: &Tensor, out: &Tensor) -> Result<()> {
        for t in [gate, x, out] {
            t.check_dtype(DType::F32)?;
        }
        gate.check_same_shape(x)?;
        gate.check_same_shape(out)?;
        out.check_no_overlap(&[gate, x])?;
        let mut st = self.dev.lock()?;
        let n = st.rows(gate.numel(), &[gate, x, out]);
        let args = Args::new()
            .p(self.p(&st, gate)?)
            .p(self.p(&st, x)?)
            .p(self.p(&st, out)?)
            .l(n as u64);
        self.dev.launch(
            &mut st,
            K::SigmoidMul,
            [stride_grid(self, n), 1, 1],
            256,
            0,
            args,
        )
    }
}
