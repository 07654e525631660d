// Stand-in for Apple's <dispatch/dispatch.h> (not on Linux): the handle types in Metal signatures.
#pragma once

// Opaque pointers, as the SDK declares them for C++ without Objective-C.
typedef struct dispatch_queue_s* dispatch_queue_t;
typedef struct dispatch_data_s* dispatch_data_t;
