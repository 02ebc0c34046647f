#pragma once
/// \file
/// cdb, the DeepSpeed-style selector: one call that gives a program its world communicator however
/// it was launched, and `AnyCommunicator`, a communicator whose backend is chosen at run time.
///
/// ```cpp
/// comm::AnyCommunicator& w = comm::init_distributed();   // comm-run, torchrun, mpirun or srun
/// w.all_reduce(std::span<float>(grad), comm::ReduceOp::avg);
/// ```
///
/// `init_distributed(options)` follows deepspeed.comm.init_distributed:
/// 1. a world already exists (from an earlier call or `set_world`) → it is returned; options that
///    conflict with it (another backend, rank or world size) throw comm::InvalidArgument;
/// 2. `init_method` "tcp://host:port" or "file:///path" → that rendezvous with the given rank and
///    world_size;
/// 3. else the launcher variables (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR,
///    MASTER_PORT) when RANK is set;
/// 4. else, with `auto_mpi_discovery`, OpenMPI (OMPI_COMM_WORLD_*), MPICH/Intel MPI (PMI_RANK,
///    PMI_SIZE, MPI_LOCALRANKID), PMIx (PMIX_RANK) and SLURM (SLURM_PROCID, SLURM_NTASKS,
///    SLURM_LOCALID, master = first host of SLURM_JOB_NODELIST) variables. No MPI library is used.
///    MASTER_PORT defaults to 29500. Where no master address can be derived the error says to set
///    MASTER_ADDR. Discovered values are exported as RANK, WORLD_SIZE, LOCAL_RANK,
///    LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT when those are unset.
/// Backend "auto" picks NCCL where comm::nccl is compiled in and a CUDA device is usable, else Shm
/// when every rank is on this host (host identities compared through the store; see
/// backends/shm.hpp), else Hierarchical<Shm, Gloo>, and says which at COMM_DEBUG=INFO. "shm" names Shm. `describe_environment()` says where each value came from.
/// With comm::mpi linked, "mpi" names Mpi: MPI_COMM_WORLD adopted when MPI is initialized, else
/// steps 2-4 and MPI initialized by comm; "auto" picks it (after NCCL) when the application
/// initialized MPI under an MPI launcher.
/// "hierarchical" names Hierarchical<Shm, Gloo> (backends/hierarchical.hpp), which "auto" picks for
/// a CPU job whose ranks span several hosts (Shm within each host, Gloo across).
///
/// AnyCommunicator has the typed API of `Communicator<B>`: element types are checked at compile time;
/// the backend's capabilities (reductions per type, custom callables) at run time, with a clear
/// comm::InvalidArgument. Each call costs one virtual dispatch. Subgroups (`split`, `new_group`)
/// are AnyCommunicators of the same backend; `monitored_barrier`, `flight_record` and
/// `dump_flight_record` forward to the backend (comm::InvalidArgument where it lacks them).
///
/// The parts, one header each: any_communicator.hpp (AnyCommunicator), world.hpp
/// (init_distributed, world, is_initialized, set_world, destroy), selection.hpp (InitOptions,
/// discovery, the backend a name or "auto" picks, from the backend list backends/list.hpp).

#include <comm/any_communicator.hpp>
#include <comm/selection.hpp>
#include <comm/world.hpp>
