#pragma once
// The whole public API of ampfuse.

#include "ampfuse/config.h"
#include "ampfuse/multi_tensor.h"
#include "ampfuse/tensor_ops.h"
