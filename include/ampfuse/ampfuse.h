#pragma once
// The whole public API of ampfuse.

#include "ampfuse/checkpoint.h"
#include "ampfuse/config.h"
#include "ampfuse/contract.h"
#include "ampfuse/distributed.h"
#include "ampfuse/fused_adagrad.h"
#include "ampfuse/fused_adam.h"
#include "ampfuse/fused_lamb.h"
#include "ampfuse/fused_rmsprop.h"
#include "ampfuse/fused_sgd.h"
#include "ampfuse/grad_scaler.h"
#include "ampfuse/multi_tensor.h"
#include "ampfuse/tensor_ops.h"
